"""The experiment: the typed config (YAML + --set), the flags every command shares, the DeepSpeed JSON
and its keys, clip shapes and a dataset's manifest, how a model splits, the node's host memory."""
