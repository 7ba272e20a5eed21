"""Multi-task prompts: static, pinned system-prompt caches keyed by task_id."""

from rtpkv.tasks.registry import (Task, TaskPrompt, TaskRegistry, parse_tasks, parse_tasks_json,
                                  tasks_from_config)

__all__ = ["Task", "TaskPrompt", "TaskRegistry", "parse_tasks", "parse_tasks_json",
           "tasks_from_config"]
