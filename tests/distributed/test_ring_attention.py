"""Ring attention (parallel/distributed/ring.py) and Ulysses x ring (parallel/distributed/sequence.py) against
full attention in one process: outputs and q, k, v gradients, fp32, through `SequenceAttention` as the models
call it (this rank's tokens in, a position-dependent `prepare`, padding at the sequence's end).

Lengths: 7 tokens at ring 2 (chunks of 4 and 3 real tokens), 13 at ring 4 (4, 4, 4, 1), 5 at ring 4 (2, 2, 1
and an all-padding chunk), 13 at Ulysses 2 x ring 2 (ring chunks of 8 and 5); 3 heads at ring 4, which no
Ulysses degree above 1 divides. Key masks (`keep`, HunyuanVideo's text mask) over the leading tokens, against
the full attention's attn_mask: random, with one batch row's first chunk all masked and the other row's second
(that chunk contributes nothing to the row: no NaN). One spawn per world size runs all of its cases. Each
rank's isend bytes are checked against the planner's ring traffic.

Compiled (aot_eager, as train.compile's blocks call them) at 2 ranks: Ulysses 2 and ring 2 through
`SequenceAttention`, and LTX-2's keys split over the sp ranks (parallel/distributed/split_keys.py, eager too),
against full attention: torch 2.11 compiled Ulysses' all-to-all and the split keys' fp32 output to zero
gradients before them (parallel/distributed/comm.py's docstring).
"""
import torch
import torch.distributed as dist

from tests.dist_utils import run_ranks

B, D = 2, 8


def _prepare(q, k, v, start):
    """A stand-in for q/k norms and rotary positions: a per-token, position-dependent transform."""
    pos = torch.arange(start, start + q.shape[1], dtype=q.dtype).view(1, -1, 1, 1)
    return torch.tanh(q) * (1 + 0.1 * pos), k * torch.cos(0.3 * pos), v


def _full(q, k, v, keep=None):
    q, k, v = _prepare(q, k, v, 0)
    mask = None if keep is None else torch.nn.functional.pad(keep, (0, q.shape[1] - keep.shape[1]), value=True)
    return torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), attn_mask=None if mask is None else mask[:, None, None]
    ).transpose(1, 2)


def _keep(tokens: int, chunk: int, g) -> torch.Tensor:
    """A key mask [B, tokens - 1] of the leading keys: random, row 1's first `chunk` keys and row 0's next masked."""
    keep = torch.rand(B, tokens - 1, generator=g) > 0.4
    keep[1, :chunk], keep[0, chunk:2 * chunk] = False, False
    return keep


def _case(ctx, tokens: int, heads: int, masked: bool, seed: int, sent: list, compiled: bool = False) -> None:
    """This rank's chunk through SequenceAttention (compiled: under torch.compile) equals full attention's rows;
    padded rows give zeros; the bytes an eager rank sends around the ring are the planner's count
    (parallel.plan.search.ring_traffic)."""
    from parallel.distributed.sequence import SequenceAttention, local_range, padded_length, split_sequence
    from parallel.plan.search import ring_traffic

    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(B, tokens, heads, D, generator=g) for _ in range(4))
    keep = (_keep(tokens, padded_length(tokens, ctx.sp_size) // ctx.ring_size, g),) if masked else ()
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _full(*full, *keep)
    ref.backward(dout)

    mine = [split_sequence(t, ctx).detach().clone().requires_grad_() for t in (q, k, v)]
    sent.clear()
    attention = SequenceAttention(ctx=ctx, tokens=tokens, prepare=_prepare)
    out = (torch.compile(attention, backend="aot_eager") if compiled else attention)(*mine, *keep)
    out.backward(split_sequence(dout, ctx))
    chunk = B * padded_length(tokens, ctx.sp_size) // ctx.sp_size * heads * D * 4     # b S/sp H/tp, fp32
    if not compiled:                    # the counter wraps the eager calls (dynamo traces the compiled ones)
        assert sum(sent) == sum(ring_traffic(chunk, ctx.ring_size, 4)), (sent, ring_traffic(chunk, ctx.ring_size, 4))
    start, stop = local_range(tokens, ctx)
    real = max(min(stop, tokens) - start, 0)
    label = (f"{tokens} tokens, {heads} heads, ulysses {ctx.ulysses_size} x ring {ctx.ring_size}, rank {ctx.rank}"
             f"{', key mask' if masked else ''}{', compiled' if compiled else ''}")
    torch.testing.assert_close(out[:, :real], ref[:, start:start + real], msg=lambda m: f"{label}: output {m}")
    assert not out[:, real:].any(), label
    for name, got, want in zip("qkv", mine, full):
        torch.testing.assert_close(got.grad[:, :real], want.grad[:, start:start + real],
                                   msg=lambda m: f"{label}: d{name} {m}")
        assert not got.grad[:, real:].any(), label


def _split_keys_case(ctx, compiled: bool) -> None:
    """Audio queries whole on every rank over video keys split across the sp ranks (7 tokens: chunks of 4 and 3 real
    keys): the output equals full attention's; each rank's loss takes 1/sp of the output's, so the ranks' dK, dV
    rows and their dQ summed over the ranks are full attention's gradients."""
    from parallel.distributed.sequence import local_range, split_sequence
    from parallel.distributed.split_keys import split_keys_attention

    tokens, audio, heads = 7, 3, 2
    g = torch.Generator().manual_seed(17)
    q, dout = (torch.randn(B, audio, heads, D, generator=g) for _ in range(2))
    k, v = (torch.randn(B, tokens, heads, D, generator=g) for _ in range(2))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in full)).transpose(1, 2)
    ref.backward(dout)

    start, stop = local_range(tokens, ctx)
    real = max(min(stop, tokens) - start, 0)
    mine = [q.clone().requires_grad_(), *(split_sequence(t, ctx).detach().clone().requires_grad_() for t in (k, v))]

    def attend(q, k, v):
        return split_keys_attention(q, k, v, real, ctx)
    out = (torch.compile(attend, backend="aot_eager") if compiled else attend)(*mine)
    out.backward(dout / ctx.sp_size)
    dq = mine[0].grad.clone()
    dist.all_reduce(dq, group=ctx.sp_group)
    label = f"split keys, rank {ctx.rank}{', compiled' if compiled else ''}"
    torch.testing.assert_close(out, ref, msg=lambda m: f"{label}: output {m}")
    torch.testing.assert_close(dq, full[0].grad, msg=lambda m: f"{label}: dq summed over the ranks {m}")
    for name, got, want in zip("kv", mine[1:], full[1:]):
        torch.testing.assert_close(got.grad[:, :real], want.grad[:, start:start + real],
                                   msg=lambda m: f"{label}: d{name} {m}")


def _rank(rank, world_size, cases, split_keys=()):
    import deepspeed
    import torch.distributed as dist

    from parallel.distributed import accelerator
    from parallel.distributed.topology import ParallelContext, ParallelDims
    deepspeed.init_distributed(dist_backend=accelerator.backend())        # Ulysses' all-to-alls

    sent, batch = [], dist.batch_isend_irecv

    def counted(ops):                                           # the ring posts its sends in batches
        sent.extend(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return batch(ops)
    dist.batch_isend_irecv = counted
    for ring, tokens, heads, masked, *compiled in cases:
        ctx = ParallelContext.build(ParallelDims(sp_size=world_size, ring_size=ring))
        _case(ctx, tokens, heads, masked, seed=tokens * 10 + heads, sent=sent, compiled=bool(compiled))
    for compiled in split_keys:
        _split_keys_case(ParallelContext.build(ParallelDims(sp_size=world_size)), compiled)
    return True


def test_ring_2_matches_full_attention_also_compiled_with_ulysses_2_and_split_keys():
    assert all(run_ranks(_rank, 2, [(2, 7, 2, False), (2, 8, 1, False), (2, 7, 2, True), (1, 7, 2, False, True),
                                    (2, 7, 2, True, True)], (False, True)))


def test_ring_4_and_ulysses_2_by_ring_2_match_full_attention():
    assert all(run_ranks(_rank, 4, [(4, 13, 3, False), (4, 5, 2, False), (2, 13, 4, False), (4, 13, 3, True),
                                    (2, 13, 4, True)]))
