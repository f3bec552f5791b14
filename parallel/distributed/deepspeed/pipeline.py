"""An explicit per-stage split of DeepSpeed's PipelineModule, and the layers a stage built.

ExplicitPipelineModule(..., parts=)  (0.19.8)
    does     overrides PipelineModule._partition_layers: module.parts = parts, and this rank's stage s
             builds layers [parts[s], parts[s + 1]) through _set_bounds (`set_stage_bounds`)
    why      PipelineModule partitions only by 'uniform', 'parameters' or 'type:'; an explicit per-stage
             split needs the private hook, which __init__ calls after _topo and global_rank are set and
             before _build()
    relies   _partition_layers(method), _set_bounds(start, stop), _topo.get_coord(rank).pipe, global_rank,
             parts (returned by partitions())
stage_layers(module)  (read, 0.19.8)
    the layers this stage built, in order: PipelineModule._build appends each to module.forward_funcs;
    stage_layer_range(module): their indices in the layer list, [_local_start, _local_stop) (_set_bounds)
set_checkpointable_layers(module, names)  (0.19.8)
    does     module.checkpointable_layers = names, after the stage is built
    why      DeepSpeed checkpoints a segment only when every layer's class name is in checkpointable_layers; a
             layer spec may build another class than its own (Wan 2.2 A14B's WanBlock builds an ExpertLayer of
             both experts' blocks), known only once built, and __init__ builds
    relies   PipelineModule._is_checkpointable reads self.checkpointable_layers, first when the engine precomputes
             each segment's answer (PipelineEngine.__init__: _precompute_checkpointable_values), after __init__
"""
from __future__ import annotations

from collections.abc import Sequence

from deepspeed.pipe import PipelineModule


def set_stage_bounds(pipeline_module, parts: Sequence[int]) -> None:
    """Explicit pipeline partition, from a `PipelineModule._partition_layers` override: stage s builds
    layers [parts[s], parts[s + 1]), len(parts) = pp_size + 1; `parts` is kept as `module.parts`
    (DeepSpeed's `partitions()`)."""
    pipeline_module.parts = parts
    stage = pipeline_module._topo.get_coord(pipeline_module.global_rank).pipe
    pipeline_module._set_bounds(start=parts[stage], stop=parts[stage + 1])


class ExplicitPipelineModule(PipelineModule):
    """A PipelineModule whose stage s builds layers [parts[s], parts[s + 1]) (len(parts) = pp_size + 1)."""

    def __init__(self, *args, parts: Sequence[int], **kwargs):
        self._explicit_parts = list(parts)        # read by _partition_layers, which __init__ calls
        super().__init__(*args, partition_method="explicit", **kwargs)

    def _partition_layers(self, method="explicit"):
        set_stage_bounds(self, self._explicit_parts)


def stage_layers(module: PipelineModule) -> list:
    """The layers (modules and functions) this pipeline stage built, in order."""
    return list(module.forward_funcs)


def stage_layer_range(module: PipelineModule) -> range:
    """The indices in the layer list of the layers this stage built (stage_layers' order)."""
    return range(module._local_start, module._local_stop)


def set_checkpointable_layers(module: PipelineModule, names) -> None:
    """Checkpoint the segments whose layers' classes are all named in `names`; after __init__ (see above)."""
    module.checkpointable_layers = sorted(names)
