"""What publishing KV events costs the engine: the engine thread's CPU time per step with
events off, with the ZeroMQ publisher on and nothing subscribed, and with a subscriber reading
every batch (rtpkv.fleet.view.ReplicaView in another process, as a router is). Goal: under 1% of
step time.

    python benchmarks/kv_events.py [--runs 3] [--block 16]

Workload: 48 requests of 256 tokens (16 distinct 192-token prefixes, then a distinct tail),
8 new tokens each, in a KV pool of 2,048 tokens: every step fills blocks (BlockStored) and
evicts others (BlockRemoved). Two figures: the median engine step (CPU seconds of the engine
thread, `time.thread_time`) per setting, interleaved over runs; and, with events on, the share
of the engine thread's time spent making events (the buffer's `_put`: building the event and
handing it to the publisher's queue). The publisher's own thread (encoding, sending) runs beside
the engine and is not engine-step time.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time

from common import bench_parser, pipeline, random_ids, setup_threads, table

from rtpkv.fleet.view import ReplicaView

REQUESTS, PREFIXES, PREFIX, TAIL, NEW, POOL_TOKENS = 48, 16, 192, 64, 8, 2048
PUB, REPLAY = "tcp://127.0.0.1:25601", "tcp://127.0.0.1:25602"


def subscribe(stop) -> None:
    """A router's part: read and apply every batch until told to stop."""
    view = ReplicaView(PUB, REPLAY)
    while not stop.is_set():
        view.poll(0.05)
    view.close()


def one_run(setting: str, block: int) -> tuple[float, float, int]:
    """(median step CPU s, share of engine time in events, events made)."""
    events = {} if setting == "off" else {"kv_events_endpoint": PUB,
                                          "kv_events_replay_endpoint": REPLAY}
    with pipeline(reuse_cache=True, seq_size_per_block=block, kv_cache_max_tokens=POOL_TOKENS,
                  concurrency_limit=8, **events) as pipe:
        engine, buffer = pipe.engine, pipe.engine.events
        steps: list[float] = []
        in_events = [0.0, 0]
        step, put = engine.step, buffer._put

        def timed_step():
            t0 = time.thread_time()
            result = step()
            steps.append(time.thread_time() - t0)
            return result

        def timed_put(event):
            t0 = time.thread_time()
            put(event)
            in_events[0] += time.thread_time() - t0
            in_events[1] += 1

        engine.step, buffer._put = timed_step, timed_put
        spawn = multiprocessing.get_context("spawn")
        stop = spawn.Event()
        reader = None
        if setting == "subscriber":
            reader = spawn.Process(target=subscribe, args=(stop,), daemon=True)
            reader.start()
            time.sleep(2)  # connected before the workload starts
        prefixes = [random_ids(PREFIX, seed=700 + i) for i in range(PREFIXES)]
        streams = [pipe(prefixes[i % PREFIXES] + random_ids(TAIL, seed=800 + i), top_k=1,
                        ignore_eos=True, max_new_tokens=NEW) for i in range(REQUESTS)]
        for s in streams:
            list(s)
        stop.set()
        if reader is not None:
            reader.join(10)
        assert pipe.cache_stats()["evictions"] > 0, "the workload must evict"
    busy = [s for s in steps if s > 0.001]  # idle loop turns are not steps
    return statistics.median(busy), in_events[0] / sum(busy), in_events[1]


def main() -> None:
    args = bench_parser(__doc__, block=16).parse_args()
    setup_threads()
    settings = ("off", "no subscriber", "subscriber")
    results: dict[str, list[tuple[float, float, int]]] = {s: [] for s in settings}
    for _ in range(args.runs):
        for setting in settings:
            results[setting].append(one_run(setting, args.block))
    base = statistics.median(r[0] for r in results["off"])
    rows = []
    for setting in settings:
        step = statistics.median(r[0] for r in results[setting])
        share = statistics.median(r[1] for r in results[setting])
        made = results[setting][0][2]
        rows.append([setting, f"{step * 1e3:.2f}", f"{(step / base - 1) * 100:+.1f}%",
                     f"{share * 100:.3f}%" if setting != "off" else "-", made])
    print(table(["events", "median step ms", "vs off", "engine time in events", "events"], rows))


if __name__ == "__main__":
    main()
