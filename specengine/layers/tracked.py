"""Layers whose parameter assignments are counted, so that a cache of their parameters can tell
when one was replaced (LlamaForCausalLM keeps its decoder layers' weights for the whole-layer op:
gathering them through nn.Module's attribute lookups every step is a sizeable share of a CPU step;
measured: bench/results/host-overheads-2026-11-29-to-12-03.md). Changes to a parameter's data or
dtype keep the object and need no count."""
from __future__ import annotations

import torch
from torch import nn


class TracksParameterAssignments(nn.Module):
    assignments = 0  # over all instances: a cache compares it with its value when it was built

    def __setattr__(self, name: str, value):
        if value is None or isinstance(value, torch.Tensor):
            TracksParameterAssignments.assignments += 1
        super().__setattr__(name, value)


class KeepsParameterViews(nn.Module):
    """A model that keeps something built from its parameters (the whole-layer ops' weight
    tuples) between calls, rebuilt once a parameter is replaced: assigned in a counted layer, or
    swapped by .to() and friends, which may put new Parameter objects in the modules' dicts
    directly (torch.__future__.set_overwrite_module_params_on_conversion), which no count sees."""

    _views = None
    _views_assignments = -1

    def parameter_views(self, build):
        """build()'s result, kept until a parameter is replaced."""
        if self._views_assignments != TracksParameterAssignments.assignments:
            self._views = build()
            self._views_assignments = TracksParameterAssignments.assignments
        return self._views

    def _apply(self, fn, recurse=True):
        result = super()._apply(fn, recurse)
        self._views_assignments = -1
        return result
