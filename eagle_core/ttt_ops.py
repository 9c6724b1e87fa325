"""The two memory-bound pieces of a TTT step as autograd functions that keep no [L, L] or [L, vocab] tensor.

`ttt_attention`: step k's attention (the causal step-0 block plus the column's own keys of steps 1..k), computed
flash-style over blocks of query rows: the forward keeps only the output and one log-sum-exp per row; the
backward recomputes each block's probabilities. Plain autograd keeps three [heads, L, L] float32 tensors per step
(masked scores, their exponentials, the probabilities); at 2048 tokens and 7 steps that was about 3 GiB.
Blocks also skip the keys above the diagonal, which plain autograd computes and masks.

`soft_cross_entropy`: the draft head and the soft cross-entropy against the target's distribution, over the
loss rows only, in blocks of rows, with the gradient of the summed loss worked out in the forward (the loss is
linear in what flows back: one scalar). Plain autograd keeps each step's [L, draft vocab] float32 log-softmax
(262 MB per step at 2048 tokens and 32k rows) and computes the head for rows that never count.

Both compute in their inputs' dtype (bf16 under autocast, as the layers around them) with float32 softmax
statistics, and are checked against the plain formulation (`eagle_core.ttt_naive.ttt_forward_naive`, `step_loss`) on
losses and gradients in tests/test_ttt.py.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# Rows per block: a block's scores are [B, heads, rows, L] float32; 256 rows x 4096 keys x 9 heads is 38 MB.
ATTENTION_BLOCK = 256
# Rows per block of the head: [rows, draft vocab] float32 logits; 512 x 32k is 64 MB.
HEAD_BLOCK = 512


def _no_autocast(device_type: str):
    return torch.autocast(device_type=device_type, enabled=False)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on x runs in here: autocast's where it is on for x's device (as for the layers
    around), else x's own. (The draft's norms return float32 under autocast: their weight is float32.)"""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def _step0_mask(rows: slice, keys: slice, key_valid, starts, device):
    """bool [B, 1, rows, keys]: row t sees keys s <= t that are real tokens (and, with `starts` [B, L], of row t's
    conversation: s >= starts[t]), and always itself."""
    t = torch.arange(rows.start, rows.stop, device=device)[:, None]
    s = torch.arange(keys.start, keys.stop, device=device)[None, :]
    mask = (s <= t) & key_valid[:, None, None, keys]
    if starts is not None:
        mask = mask & (s >= starts[:, None, rows, None])
    return mask | (s == t)


def block_first_keys(starts, length: int) -> list[int] | None:
    """Per block of ATTENTION_BLOCK query rows of a packed batch, the first step-0 key any of its rows sees: the
    earliest conversation start among them, over the batch (`starts`: `eagle_core.ttt_batch.document_starts`).
    The keys before it are masked for the whole block, so the blocks skip them: a packed row's attention then costs
    about what its conversations cost one per row, not its whole causal block. None (no skipping) without `starts`.
    One host sync; `ttt_forward` calls it once for its K steps."""
    if starts is None:
        return None
    n = -(-length // ATTENTION_BLOCK)
    padded = F.pad(starts, (0, n * ATTENTION_BLOCK - length), value=length)  # the short last block
    return padded.view(starts.shape[0], n, ATTENTION_BLOCK).amin((0, 2)).clamp(min=0).tolist()


class _TTTAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, key_valid, starts, first_keys, q, k0, v0, *diag):
        # q, k0, v0, diag: [B, nh, L, D] (diag = the column's keys of steps 1..k, then its values); key_valid [B, L];
        # starts: [B, L] each column's conversation start (a packed batch) or None; first_keys: `block_first_keys`
        n = len(diag) // 2
        diag_k, diag_v = diag[:n], diag[n:]
        ctx.starts, ctx.first_keys = starts, first_keys  # no gradient: kept on ctx with the step's other constants
        scale = 1.0 / math.sqrt(q.shape[-1])
        L = q.shape[2]
        with _no_autocast(q.device.type):
            d = [(q * kj).sum(-1).float() * scale for kj in diag_k]  # n x [B, nh, L]
            out = torch.empty_like(q)
            lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
            for i, a in enumerate(range(0, L, ATTENTION_BLOCK)):
                rows = slice(a, min(a + ATTENTION_BLOCK, L))
                # causal: keys past the block's last row never count; packed: nor those before its first start
                keys = slice(first_keys[i] if first_keys else 0, rows.stop)
                s = (q[:, :, rows] @ k0[:, :, keys].transpose(-1, -2)).float() * scale
                s = s.masked_fill(~_step0_mask(rows, keys, key_valid, ctx.starts, q.device), float("-inf"))
                block_lse = torch.logsumexp(s, dim=-1)
                if d:
                    block_lse = torch.logaddexp(block_lse, torch.logsumexp(
                        torch.stack([dj[:, :, rows] for dj in d], -1), dim=-1))
                lse[:, :, rows] = block_lse
                o = torch.exp(s - block_lse[..., None]).to(v0.dtype) @ v0[:, :, keys]
                for dj, vj in zip(d, diag_v):
                    o = o + torch.exp(dj[:, :, rows] - block_lse)[..., None].to(vj.dtype) * vj[:, :, rows]
                out[:, :, rows] = o
        ctx.save_for_backward(key_valid, q, k0, v0, out, lse, *diag)
        ctx.n = n
        return out

    @staticmethod
    def backward(ctx, grad_out):
        key_valid, q, k0, v0, out, lse, *diag = ctx.saved_tensors
        diag_k, diag_v = diag[:ctx.n], diag[ctx.n:]
        scale = 1.0 / math.sqrt(q.shape[-1])
        L = q.shape[2]
        with _no_autocast(q.device.type):
            g = grad_out.to(q.dtype)
            # Delta_t = sum_s P_ts dP_ts = <dO_t, O_t>: the softmax backward's row term, over all keys at once.
            delta = (g.float() * out.float()).sum(-1)  # [B, nh, L]
            dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            dk0 = torch.zeros_like(dq)
            dv0 = torch.zeros_like(dq)
            for i, a in enumerate(range(0, L, ATTENTION_BLOCK)):
                rows = slice(a, min(a + ATTENTION_BLOCK, L))
                keys = slice(ctx.first_keys[i] if ctx.first_keys else 0, rows.stop)
                s = (q[:, :, rows] @ k0[:, :, keys].transpose(-1, -2)).float() * scale
                s = s.masked_fill(~_step0_mask(rows, keys, key_valid, ctx.starts, q.device), float("-inf"))
                p = torch.exp(s - lse[:, :, rows, None])  # [B, nh, rows, keys]
                g_rows = g[:, :, rows]
                dv0[:, :, keys] += p.to(q.dtype).transpose(-1, -2) @ g_rows
                dp = (g_rows @ v0[:, :, keys].transpose(-1, -2)).float()
                ds = (p * (dp - delta[:, :, rows, None])).to(q.dtype)
                dq[:, :, rows] += ds @ k0[:, :, keys]
                dk0[:, :, keys] += ds.transpose(-1, -2) @ q[:, :, rows]
            dk_diag, dv_diag = [], []
            for kj, vj in zip(diag_k, diag_v):
                pj = torch.exp((q * kj).sum(-1).float() * scale - lse)  # [B, nh, L]
                dv_diag.append((pj[..., None] * g.float()).to(vj.dtype))
                dsj = pj * ((g.float() * vj.float()).sum(-1) - delta)
                dq += dsj[..., None] * kj.float()
                dk_diag.append((dsj[..., None] * q.float() * scale).to(kj.dtype))
            dq = (dq * scale).to(q.dtype)
            dk0 = (dk0 * scale).to(k0.dtype)
        return (None, None, None, dq, dk0, dv0.to(v0.dtype), *dk_diag, *dv_diag)


def ttt_attention(q, k0, v0, key_valid, diag_k, diag_v, starts=None, first_keys=None):
    """Attention of one TTT step: the causal step-0 block plus per-column diagonal entries.

    q: [B, nh, L, D]; k0, v0: [B, nh, L, D] (kv heads already repeated); key_valid: bool [B, L] (padding = False)
    diag_k, diag_v: the same column's keys/values of steps 1..k, each [B, nh, L, D]
    starts: optional [B, L], the column where each column's conversation starts (a packed batch,
    `eagle_core.ttt_batch.document_starts`): the step-0 keys of other conversations are masked (block-diagonal);
    first_keys: `block_first_keys(starts, L)`, the keys each block of rows skips (None: none skipped)
    returns [B, nh, L, D]: softmax over {step-0 keys s <= t that are real (and of t's conversation), and t itself}
    + {the k diagonal keys}
    """
    dtype = compute_dtype(q)
    tensors = [t.to(dtype) for t in (q, k0, v0, *diag_k, *diag_v)]
    return _TTTAttention.apply(key_valid.bool(), starts, first_keys, *tensors)


# The lm_head weight gradient of a low-precision step: one GEMM over all rows with a float32 result (True), or a
# float32 `+=` of each block's product (False: the float32 path's way, whose result stays bit for bit). None: one
# GEMM on CUDA, where it is one fp32-output bf16 GEMM instead of a [Vd, H] float32 read-modify-write per block of
# 512 rows (~2 GB of traffic per block at Llama-3.1-8B's draft); blocks on a CPU, where the one GEMM has to run in
# float32 (measured: 328 against 263 ms median for 1 024 rows x 8 192 x 576, one thread).
ONE_GEMM_WEIGHT_GRAD: bool | None = None


def float_out_mm(a, b):
    """a @ b for low-precision a, b with a float32 result: one GEMM where the device has an fp32-output one (CUDA's
    `torch.mm(..., out_dtype=)`), else float32 math on the rounded inputs. Rounding a product to bf16 would cost
    ~0.4 % of its magnitude (at logits of ~20, ~4 % of a probability; a weight gradient summed from bf16 blocks
    loses as much per block)."""
    if a.device.type == "cuda":
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):  # a torch without `mm.dtype`
            pass
    return a.float() @ b.float()


def _head_blocks(x, weight, target_p, target_argmax, d2t, grad_x: bool, grad_w: bool, weight_low=None):
    """Loss sum, hits, and (when asked) the loss sum's gradients for x and weight, a block of rows at a time.
    weight_low: `weight` already in x's dtype (cast once per training step by the caller), else cast here."""
    with _no_autocast(x.device.type):
        w = weight_low if weight_low is not None and weight_low.dtype == x.dtype else weight.to(x.dtype)
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        hits = torch.zeros((), dtype=torch.float32, device=x.device)
        gx = torch.empty_like(x) if grad_x else None
        one_gemm = grad_w and x.dtype != torch.float32 and (
            x.device.type == "cuda" if ONE_GEMM_WEIGHT_GRAD is None else ONE_GEMM_WEIGHT_GRAD)
        # one_gemm: every block's logits gradient kept ([rows, Vd] in x's dtype, only until the GEMM below)
        g_all = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device) if one_gemm else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if grad_w and not one_gemm else None
        for a in range(0, x.shape[0], HEAD_BLOCK):
            rows = slice(a, a + HEAD_BLOCK)
            logits = F.linear(x[rows], w).float()  # [n, Vd]
            p = target_p[rows]
            p_sum = p.sum(-1, keepdim=True)
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            # -sum_v p_v log softmax(l)_v = sum(p) * lse - <p, l>;  d/dl = sum(p) * softmax(l) - p
            loss += (p_sum * lse).sum() - (p * logits).sum()
            arg = logits.argmax(-1)
            hits += ((arg + d2t[arg]) == target_argmax[rows]).sum()
            if gx is None and gw is None:
                continue
            g = (torch.exp(logits - lse) * p_sum - p).to(x.dtype)
            if gx is not None:
                gx[rows] = g @ w
            if g_all is not None:
                g_all[rows] = g
            elif gw is not None:
                gw += (g.transpose(0, 1) @ x[rows]).float()
        if g_all is not None:
            gw = float_out_mm(g_all.t(), x)
    return loss, hits, gx, gw


class _SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target_p, target_argmax, d2t, weight_low):
        loss, hits, gx, gw = _head_blocks(x, weight, target_p, target_argmax, d2t, *ctx.needs_input_grad[:2],
                                          weight_low=weight_low)
        ctx.save_for_backward(gx, gw)
        ctx.mark_non_differentiable(hits)
        return loss, hits

    @staticmethod
    def backward(ctx, grad_loss, _grad_hits):
        gx, gw = ctx.saved_tensors
        return (None if gx is None else gx * grad_loss.to(gx.dtype),
                None if gw is None else gw * grad_loss, None, None, None, None)


def soft_cross_entropy(x, weight, target_p, target_argmax, d2t, weight_low=None):
    """(sum over rows of -<target_p, log_softmax(x @ weight.T)>, number of rows whose head argmax, mapped to
    target ids through d2t, equals target_argmax). x: [N, H]; weight: [Vd, H]; target_p: [N, Vd].
    weight_low: optional detached copy of `weight` in the compute dtype, made once per training step (the TTT
    steps share one head); the gradient still goes to `weight`, in its own dtype.

    With gradients on, the head's gradients are computed here, in the forward (a scalar loss needs no more).
    """
    x = x.to(compute_dtype(x))
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _SoftCrossEntropy.apply(x, weight, target_p, target_argmax, d2t, weight_low)
    loss, hits, _, _ = _head_blocks(x, weight, target_p, target_argmax, d2t, False, False, weight_low)
    return loss, hits
