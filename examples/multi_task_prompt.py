"""rtp-llm's MultiTaskPrompt demo: system prompts from examples/tasks.json are prefilled once at
start-up and pinned; a request naming task_id starts from that cache.

    python examples/multi_task_prompt.py [MODEL_DIR]
"""

import os
from pathlib import Path

os.environ.setdefault("MULTI_TASK_PROMPT", str(Path(__file__).with_name("tasks.json")))
os.environ.setdefault("SEQ_SIZE_PER_BLOCK", "4")
# os.environ["MULTI_TASK_PROMPT_STR"] = "{json str}"

from example_args import model_path  # noqa: E402
from rtpkv.model_factory import ModelConfig, ModelFactory  # noqa: E402
from rtpkv.pipeline import Pipeline  # noqa: E402

model_name = model_path(__doc__)
model = ModelFactory.from_huggingface(model_name, ModelConfig())
pipeline = Pipeline(model, model.tokenizer)

# Using the system prompt of task_id=1 to concatenate the request
generate_config = {"top_k": 1, "max_new_tokens": 100, "task_id": "1"}
for res in pipeline("hello, what's your name", generate_config=generate_config):
    print(res.batch_response)
print(f"with task_id:    prefix_len={res.aux_info['prefix_len']} reuse_len={res.aux_info['reuse_len']}")

# Not using a system prompt
generate_config = {"top_k": 1, "max_new_tokens": 100}
for res in pipeline("hello, what's your name", generate_config=generate_config):
    print(res.batch_response)
print(f"without task_id: prefix_len={res.aux_info['prefix_len']} reuse_len={res.aux_info['reuse_len']}")
print("pinned blocks:", pipeline.cache_stats()["blocks_pinned"])
pipeline.stop()
