"""rtp-llm's ReuseCache example: the second prompt reuses the KV of the first one's full blocks.

    python examples/reuse_cache.py [MODEL_DIR]

Without MODEL_DIR it runs on the tiny built-in demo checkpoint. REUSE_CACHE and
SEQ_SIZE_PER_BLOCK come from the environment (this script defaults them to 1 and 4).
"""

import os

os.environ.setdefault("REUSE_CACHE", "1")
os.environ.setdefault("SEQ_SIZE_PER_BLOCK", "4")

from example_args import model_path  # noqa: E402
from rtpkv.model_factory import ModelConfig, ModelFactory  # noqa: E402
from rtpkv.pipeline import Pipeline  # noqa: E402

model_name = model_path(__doc__)
model = ModelFactory.from_huggingface(model_name, ModelConfig())
pipeline = Pipeline(model, model.tokenizer)
generate_config = {"top_k": 1, "max_new_tokens": 100}
block = pipeline.config.seq_size_per_block

for res in pipeline("hello, what's your name", generate_config=generate_config):
    print(res.batch_response)
first_tokens = model.tokenizer("hello, what's your name").input_ids + res.output_ids

# This query can reuse the KV cache of the previous one. reuse_len is always a multiple of
# SEQ_SIZE_PER_BLOCK: floor(min(common prefix, prompt_len - 1) / B) * B.
second = "hello, what's your name? how old are you?"
for res in pipeline(second, generate_config=generate_config):
    print(res.batch_response)
ids = model.tokenizer(second).input_ids
common = next((i for i, (a, b) in enumerate(zip(first_tokens, ids)) if a != b),
              min(len(first_tokens), len(ids)))
predicted = min(common, len(ids) - 1) // block * block
print(f"reuse_len={res.aux_info['reuse_len']} (predicted {predicted}, SEQ_SIZE_PER_BLOCK={block})")
pipeline.stop()
