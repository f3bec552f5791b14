"""Ulysses' all-to-all (deepspeed.sequence.layer) returning a tensor that torch 2.11's compiler differentiates.

traceable_ulysses()  (0.19.8)
    does     replaces deepspeed.sequence.layer.post_all2all, the layout step _SeqAllToAll's forward ends with,
             by one that returns the reshape itself: the same values and layout, without the trailing
             `.contiguous()` (a reshape of a contiguous tensor is contiguous: that call returns its input)
    why      under torch.compile, torch 2.11's dynamo adds an autograd Function's intermediates to its forward
             graph's outputs; when one is the returned tensor under another name (here the reshape, which
             `.contiguous()` returned) the backward gets zeros for the output, so at sp 2 every weight before
             the attention trained on a zero gradient from it (pytorch/pytorch#180642, fixed in torch 2.12;
             tests/distributed/test_compile_layouts.py). Eager runs and torch >= 2.12 are unaffected
    relies   single_all_to_all calling the module global post_all2all(permute_idx, res_shape) and returning
             what its result makes of the exchanged tensor; post_all2all's permute, contiguous, reshape,
             contiguous
"""
from __future__ import annotations

from deepspeed.sequence import layer


def _post_all2all(permute_idx, res_shape):
    """post_all2all's function, ending at the reshape."""
    def post_func(input):
        if permute_idx is not None:
            input = input.permute(permute_idx).contiguous()
        return input.reshape(res_shape)
    return post_func


def traceable_ulysses() -> None:
    """Install the patch (idempotent; before the first compiled Ulysses exchange)."""
    layer.post_all2all = _post_all2all
