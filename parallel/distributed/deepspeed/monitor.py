"""The toolkit's figures to DeepSpeed's monitors (TensorBoard, CSV, Comet, wandb).

write_monitor_events(monitor, events)  (0.19.8)
    does     passes the toolkit's (name, value, step) figures to the MonitorMaster's monitors, but to wandb
             itself: without a step, with the step as a figure ("step") that wandb.define_metric makes
             the x-axis of train/* and val/*
    why      wandb drops (with a warning) any log whose step is below the last one it saw, and the engine
             logs Train/Samples/lr at the count of samples seen (4, 8, ...): WandbMonitor.write_events
             would hand wandb steps 1, 2, ... and lose every figure
    relies   MonitorMaster's tb_monitor / wandb_monitor / csv_monitor / comet_monitor attributes, each
             None or a monitor with .enabled and write_events; WandbMonitor initialising wandb on rank 0

close_monitors(monitor)  (0.19.8)
    does     closes TensorBoard's summary writer, ends the wandb run (rank 0) and comet's experiment
    why      a launched rank leaves without the interpreter's teardown (parallel.experiment.cli.run), where these would
             otherwise be flushed and closed by atexit handlers: the wandb run file would end unfinished
    relies   TensorBoardMonitor.summary_writer, CometMonitor.experiment; wandb.finish
"""
from __future__ import annotations

import torch

MONITORS = ("tb_monitor", "wandb_monitor", "csv_monitor", "comet_monitor")      # MonitorMaster's attributes


def write_monitor_events(monitor, events: list[tuple[str, float, int]]) -> None:
    """`events` (name, value, step), all of one step, to every monitor of DeepSpeed's MonitorMaster; wandb's
    as the module docstring says."""
    for name in MONITORS:
        sink = getattr(monitor, name, None)
        if sink is None or not sink.enabled:
            continue
        if name != "wandb_monitor":
            sink.write_events(events)
        elif torch.distributed.get_rank() == 0:             # where WandbMonitor called wandb.init
            import wandb
            if not getattr(sink, "_vdp_step_metric", False):
                wandb.define_metric("step")
                for prefix in ("train/*", "val/*"):
                    wandb.define_metric(prefix, step_metric="step")
                sink._vdp_step_metric = True
            wandb.log({"step": events[0][2], **{label: value for label, value, _ in events}})


def close_monitors(monitor) -> None:
    """Close what write_monitor_events writes to, before the process group goes (wandb's run lives on rank 0)."""
    if monitor is None:
        return
    tb = getattr(monitor, "tb_monitor", None)
    if tb is not None and tb.enabled and tb.summary_writer is not None:
        tb.summary_writer.close()
    wb = getattr(monitor, "wandb_monitor", None)
    if wb is not None and wb.enabled and torch.distributed.get_rank() == 0:
        import wandb
        wandb.finish()
    comet = getattr(monitor, "comet_monitor", None)
    if comet is not None and comet.enabled and comet.experiment is not None:
        comet.experiment.end()
