"""The multi-task prompt registry: task_id -> system prompt, parsed from MULTI_TASK_PROMPT
(a JSON file), MULTI_TASK_PROMPT_STR (the same JSON inline) or given in code."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional, Union

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from rtpkv.config import RuntimeConfig, describe_validation_error
from rtpkv.errors import ConfigError, UnknownTaskError

if TYPE_CHECKING:
    from rtpkv.cache import PinnedPrefix

log = logging.getLogger("rtpkv")


class TaskPrompt(BaseModel):
    """One entry: {"task_id": 1 or "1", "prompt": "..."}; ids are normalised to strings."""

    model_config = ConfigDict(extra="forbid", strict=False)

    task_id: str
    prompt: str

    @field_validator("task_id", mode="before")
    @classmethod
    def _id_as_text(cls, value: Any) -> str:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError("task_id must be an int or a string")
        text = str(value)
        if not text:
            raise ValueError("task_id must not be empty")
        return text

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value: str) -> str:
        if not value:
            raise ValueError("prompt must not be empty")
        return value


def parse_tasks(entries: Any, source: str) -> list[TaskPrompt]:
    """Validate a decoded JSON list; errors name the source, the entry's index and the fault."""
    if not isinstance(entries, list):
        raise ConfigError(f"{source}: expected a JSON list of {{\"task_id\", \"prompt\"}} "
                          f"objects, got {type(entries).__name__}")
    tasks: list[TaskPrompt] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ConfigError(f"{source}: entry {i} is {type(entry).__name__}, expected an "
                              "object with keys task_id and prompt")
        try:
            task = TaskPrompt(**entry)
        except ValidationError as exc:
            raise ConfigError(f"{source}: entry {i}: {describe_validation_error(exc)}") from None
        if task.task_id in seen:
            raise ConfigError(f"{source}: entry {i} repeats task_id {task.task_id!r}")
        seen.add(task.task_id)
        tasks.append(task)
    return tasks


def parse_tasks_json(text: Union[str, bytes], source: str) -> list[TaskPrompt]:
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"{source}: invalid JSON: {exc}") from None
    return parse_tasks(data, source)


def tasks_from_config(config: RuntimeConfig) -> list[TaskPrompt]:
    """MULTI_TASK_PROMPT (a file) wins over MULTI_TASK_PROMPT_STR when both are set."""
    if config.multi_task_prompt:
        path = Path(config.multi_task_prompt)
        if config.multi_task_prompt_str:
            log.warning("both MULTI_TASK_PROMPT and MULTI_TASK_PROMPT_STR are set; using the file %s", path)
        source = f"MULTI_TASK_PROMPT file {str(path)!r}"
        if not path.is_file():
            raise ConfigError(f"{source} does not exist")
        return parse_tasks_json(path.read_bytes(), source)
    if config.multi_task_prompt_str:
        return parse_tasks_json(config.multi_task_prompt_str, "MULTI_TASK_PROMPT_STR")
    return []


@dataclass
class Task:
    task_id: str
    prompt: str
    token_ids: list[int]
    pinned: Optional["PinnedPrefix"] = None  # the cache's handle on its pinned blocks


class TaskRegistry:
    """Known tasks with their tokenised prompts and the handles of their pinned KV blocks."""

    def __init__(self) -> None:
        self._tasks: dict[str, Task] = {}

    def get(self, task_id: Union[str, int]) -> Task:
        key = str(task_id)
        if key not in self._tasks:
            known = ", ".join(repr(k) for k in self._tasks) or "none"
            raise UnknownTaskError(f"unknown task_id {key!r}; known task ids: {known}")
        return self._tasks[key]

    def add(self, task: Task) -> None:
        self._tasks[task.task_id] = task

    def pop(self, task_id: Union[str, int]) -> Task:
        task = self.get(task_id)
        del self._tasks[task.task_id]
        return task

    def __contains__(self, task_id: object) -> bool:
        return str(task_id) in self._tasks

    def __iter__(self) -> Iterable[Task]:
        return iter(list(self._tasks.values()))

    def ids(self) -> list[str]:
        return list(self._tasks)
