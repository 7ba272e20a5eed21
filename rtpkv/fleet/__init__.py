"""rtpkv as a worker behind cache-aware routers: KV events on the wire in vLLM's ZeroMQ format
(`publisher`, `wire`), a consumer that rebuilds a replica's cached set from them (`view`), a
launcher for N replicas plus a router on one machine (`launcher`), and a Pipeline as a worker
of NVIDIA Dynamo (`dynamo_worker`)."""
