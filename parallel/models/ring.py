"""Ring attention (Liu et al. 2023): self-attention over a sequence split over C contexts, written from scratch.

Context ``i`` of a ring holds its slice of the queries, keys and values (``(B, S_i, d)`` each, B the examples times
the heads). Attention needs every query against every key. Each context keeps its queries; the blocks of keys
and values go round the ring: at each of C steps a context scores its queries against the block it holds, then
passes that block on to the next context (a copy between neighbours) and receives the previous one's. After C
steps every block has visited every context.

The softmax over keys that arrive a block at a time is the **online softmax** (Milakov and Gimelshein 2018; the
heart of FlashAttention): keep, for each query, the largest score seen ``m``, the sum of ``exp(score - m)`` seen
``l`` and the weighted sum of values ``o``; a new block with larger scores rescales the old sums by
``exp(m_old - m_new)``. At the end ``o / l`` is the softmax-weighted sum over every key, equal to attention over
the whole sequence up to float rounding. ``m`` only shifts the exponents (the softmax does not change with a
shift), so no gradient flows through it.

The ring is run by autograd as any other operators: its backward sends the gradients of the blocks back round the
ring through the same copies (the real ring attention recomputes the scores in backward instead of keeping them;
here every block's scores are kept, the memory of ordinary attention over the whole sequence).

Its bytes: every key and value block travels C - 1 hops, so one attention moves ``(C - 1) x 2 x B x S x d x 4``
bytes of float32 forward (B x S x d each for the keys and the values of the whole sequence), and as many backward.

>>> import mxnet as mx
>>> q, k, v = (mx.nd.random.normal(shape=(2, 6, 4)) for _ in range(3))
>>> bounds = [0, 3, 6]
>>> parts = [[x[:, a:b].copyto(mx.cpu(i)) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))] for x in (q, k, v)]
>>> outs = ring_attention(*parts, scale=0.5)
>>> whole = attention(q, k, v, scale=0.5)
>>> float(mx.nd.abs(mx.nd.concat(*[o.as_in_context(mx.cpu()) for o in outs], dim=1) - whole).max().asscalar()) < 1e-6
True
"""
import mxnet as mx

from ..comm import algorithms

__all__ = ["ring_attention", "attention", "ring_bytes"]


def attention(q, k, v, scale):
    """``softmax(scale q k^T) v`` over the whole sequence, ``(B, S, d)`` each: the reference."""
    return mx.nd.batch_dot(mx.nd.softmax(mx.nd.batch_dot(q * scale, k, transpose_b=True), axis=-1), v)


def ring_attention(qs, ks, vs, scale):
    """Attention of each context's queries ``qs[i]`` over every context's keys ``ks`` and values ``vs`` (one slice
    of the sequence a context, in order, each on its context), the blocks of keys and values passed round the ring
    and the softmax taken online (see the module's docstring). Returns each context's outputs, on its context.
    Queued; does not block."""
    C = len(qs)
    held_k, held_v = list(ks), list(vs)
    state = [None] * C   # each context's (m, l, o)
    for step in range(C):
        if step:   # pass each block on: context i receives what context i - 1 held
            held_k = [algorithms.copy_to(held_k[i - 1], qs[i].context) for i in range(C)]
            held_v = [algorithms.copy_to(held_v[i - 1], qs[i].context) for i in range(C)]
        for i in range(C):
            state[i] = _online_step(state[i], qs[i] * scale, held_k[i], held_v[i])
    return [mx.nd.broadcast_div(o, l) for _, l, o in state]


def _online_step(state, q, k, v):
    """One block of keys ``k`` and values ``v`` into a query block's running ``(m, l, o)`` (None: the first)."""
    scores = mx.nd.batch_dot(q, k, transpose_b=True)              # (B, S_q, S_k)
    top = mx.nd.max(scores, axis=-1, keepdims=True).detach()     # only shifts the exponents
    if state is None:
        p = mx.nd.exp(mx.nd.broadcast_sub(scores, top))
        return top, mx.nd.sum(p, axis=-1, keepdims=True), mx.nd.batch_dot(p, v)
    m, l, o = state
    new = mx.nd.maximum(m, top)
    rescale = mx.nd.exp(m - new)
    p = mx.nd.exp(mx.nd.broadcast_sub(scores, new))
    return (new, mx.nd.broadcast_mul(l, rescale) + mx.nd.sum(p, axis=-1, keepdims=True),
            mx.nd.broadcast_mul(o, rescale) + mx.nd.batch_dot(p, v))


def ring_bytes(batch, length, width, contexts, itemsize=4):
    """The bytes one ring attention's forward copies: each of the keys' and values' blocks (``batch`` x ``length``
    x ``width`` in all) travels ``contexts - 1`` hops."""
    return (contexts - 1) * 2 * batch * length * width * itemsize
