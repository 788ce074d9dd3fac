"""The memory planner: per-device (and, for GPU layouts, per-node host) bytes of a composed run before anything
loads. ``shapes.py``: the arithmetic of tensors and the architectures' shapes; ``plan.py``: one function per phase
and the totals; ``advice.py``: the table, the refusal and the overrides that would fit. docs/memory-planner.md."""

from grail_exp.memory.advice import check, refusal, render, replan, suggest, tight_warning
from grail_exp.memory.plan import (
                                  Line,
                                  MemoryPlan,
                                  dist_timeout,
                                  needed_dist_timeout,
                                  plan,
                                  planned_mem_gb,
                                  planned_step_seconds,
                                  stop_lead,
)
from grail_exp.memory.shapes import (
                                  PLAN_ERROR,
                                  VLLM_CPU_PAGE_FACTOR,
                                  GiB,
                                  PlanError,
                                  Shape,
                                  layer_activation_bytes,
                                  logits_bytes,
                                  model_shape,
                                  vllm_kv_cache_bytes,
)

__all__ = ["GiB", "Line", "MemoryPlan", "PLAN_ERROR", "PlanError", "Shape", "VLLM_CPU_PAGE_FACTOR", "check", "dist_timeout",
           "layer_activation_bytes", "logits_bytes", "model_shape", "needed_dist_timeout", "plan", "planned_mem_gb",
           "planned_step_seconds",
           "refusal", "render", "replan", "stop_lead", "suggest", "tight_warning", "vllm_kv_cache_bytes"]
