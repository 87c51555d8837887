"""Verifiable tasks: the embedded arithmetic task and a JSONL loader for user data."""

from dppo_ext.tasks.arithmetic import arithmetic_problems, make_arithmetic_task
from dppo_ext.tasks.base import VERIFIERS, Problem, Task, extract_number, get_verifier
from dppo_ext.tasks.jsonl import DataFormatError, load_jsonl_problems, load_jsonl_task

__all__ = [
    "VERIFIERS",
    "DataFormatError",
    "Problem",
    "Task",
    "arithmetic_problems",
    "extract_number",
    "get_verifier",
    "load_jsonl_problems",
    "load_jsonl_task",
    "make_arithmetic_task",
]
