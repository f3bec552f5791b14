"""The memory planner: memory model, activation trace, layout search, rendering, and the probe that
measures a real step against the plan."""
