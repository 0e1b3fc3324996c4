"""Random ragged paged-attention inputs that expose stray reads, and the case grid for kernel tests.

Every sequence's blocks are drawn at random from the pool (so tables are non-contiguous and
interleaved), the null block 0 and every slot no sequence owns hold NaN, and padding rows of q hold
random values: a kernel that reads past a sequence's length, or lets a padding row leak, gives NaN
or a mismatch.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import ragged_paged_attention_reference


@dataclasses.dataclass(frozen=True, slots=True)
class Case:
    """One batch; q_lens/kv_lens per real sequence, the rest are static padded shapes."""
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    num_kv_heads: int = 2
    group: int = 1
    head_dim: int = 64
    block_size: int = 16
    dtype: str = "float32"
    num_tokens: int = 16        # packed query rows (>= sum(q_lens)); the rest are padding
    max_seqs: int = 4           # rows of kv_lens / block_tables (>= len(q_lens))
    width: int = 4              # block-table width (pages per sequence)
    num_blocks: int = 16        # physical blocks, block 0 the null block
    sliding_window: int | None = None
    soft_cap: float | None = None
    seed: int = 0

    def __post_init__(self):
        if len(self.q_lens) != len(self.kv_lens) or len(self.q_lens) > self.max_seqs:
            raise ValueError(f"q_lens {self.q_lens} / kv_lens {self.kv_lens} / max_seqs {self.max_seqs}")
        if sum(self.q_lens) > self.num_tokens:
            raise ValueError(f"sum(q_lens)={sum(self.q_lens)} > num_tokens={self.num_tokens}")
        for ql, kl in zip(self.q_lens, self.kv_lens):
            if not 1 <= ql <= kl or -(-kl // self.block_size) > self.width:
                raise ValueError(f"q_len {ql} kv_len {kl} width {self.width} block_size {self.block_size}")
        pages = sum(-(-kl // self.block_size) for kl in self.kv_lens)
        if pages > self.num_blocks - 1:
            raise ValueError(f"needs {pages} pages, pool has {self.num_blocks - 1}")

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.group

    def label(self) -> str:
        extra = "".join([f"-w{self.sliding_window}" if self.sliding_window else "",
                         f"-cap{self.soft_cap:g}" if self.soft_cap else ""])
        return (f"q{list(self.q_lens)}-kv{list(self.kv_lens)}-K{self.num_kv_heads}g{self.group}"
                f"-H{self.head_dim}-bs{self.block_size}-{self.dtype}{extra}")


def make_inputs(case: Case) -> dict:
    """Arrays in the reference's signature order plus the keyword arguments."""
    rng = np.random.default_rng(case.seed)
    dtype = jnp.dtype(case.dtype)
    shape = (case.num_blocks, case.block_size, case.num_kv_heads, case.head_dim)
    k_cache = np.full(shape, np.nan, np.float32)
    v_cache = np.full(shape, np.nan, np.float32)
    tables = np.zeros((case.max_seqs, case.width), np.int32)   # padding entries: null block 0
    free = rng.permutation(np.arange(1, case.num_blocks))       # random, non-contiguous pages
    used = 0
    for s, kl in enumerate(case.kv_lens):
        n_pages = -(-kl // case.block_size)
        tables[s, :n_pages] = free[used:used + n_pages]
        used += n_pages
        for j in range(n_pages):
            n = min(case.block_size, kl - j * case.block_size)   # tail slots stay NaN
            k_cache[tables[s, j], :n] = rng.standard_normal((n, case.num_kv_heads, case.head_dim))
            v_cache[tables[s, j], :n] = rng.standard_normal((n, case.num_kv_heads, case.head_dim))
    q = rng.standard_normal((case.num_tokens, case.num_heads, case.head_dim)).astype(np.float32)
    kv_lens = np.zeros(case.max_seqs, np.int32)
    kv_lens[:len(case.kv_lens)] = case.kv_lens
    cu = np.zeros(case.max_seqs + 1, np.int32)
    cu[1:len(case.q_lens) + 1] = np.cumsum(case.q_lens)
    cu[len(case.q_lens) + 1:] = cu[len(case.q_lens)]
    return dict(
        q=jnp.asarray(q, dtype), k_cache=jnp.asarray(k_cache, dtype), v_cache=jnp.asarray(v_cache, dtype),
        kv_lens=jnp.asarray(kv_lens), block_tables=jnp.asarray(tables), cu_q_lens=jnp.asarray(cu),
        num_seqs=jnp.asarray([len(case.q_lens)], jnp.int32),
        sm_scale=1.0 / np.sqrt(case.head_dim), sliding_window=case.sliding_window,
        soft_cap=case.soft_cap,
    )


# --- the case grid ---------------------------------------------------------------------------
# Three batch kinds share static shapes (16 query rows, 4 sequence slots, 4 pages of 16 per
# sequence), so they differ only in data; each puts a context of length 1, one ending on a
# block boundary and one at the table's maximum in the same batch where it can.
BATCHES = {
    # q_lens, kv_lens
    "decode": ((1, 1, 1, 1), (1, 16, 64, 33)),
    "prefill": ((6, 10), (64, 10)),              # a chunk ending at the maximum, a fresh prompt
    "mixed": ((1, 8, 1, 3), (1, 32, 64, 17)),
}
GROUPS = (1, 3, 4, 8)
HEAD_DIMS = (64, 128)
DTYPES = ("float32", "bfloat16", "float16")

# Max |kernel - reference| allowed, as atol + rtol * |reference|. The reference accumulates in
# float32 from inputs of the given dtype; kernels also round P to the input dtype before P V,
# and the output is rounded to it: one or two ulps of the dtype.
TOLERANCES = {
    "float32": (2e-5, 2e-5),
    "bfloat16": (3e-2, 2e-2),
    "float16": (4e-3, 4e-3),
}


def case(kind: str, *, group: int, head_dim: int, dtype: str, **extra) -> Case:
    q_lens, kv_lens = BATCHES[kind]
    return Case(q_lens=q_lens, kv_lens=kv_lens, group=group, head_dim=head_dim, dtype=dtype, **extra)


def full_grid(dtypes=DTYPES) -> list[Case]:
    return [case(kind, group=g, head_dim=h, dtype=d, seed=i)
            for i, (kind, g, h, d) in enumerate(itertools.product(BATCHES, GROUPS, HEAD_DIMS, dtypes))]


def with_options(c: Case, **changes) -> Case:
    return dataclasses.replace(c, **changes)


def assert_matches_reference(got, want, c: Case) -> None:
    """Within the dtype's tolerance everywhere, no NaN, and padding query rows exactly zero."""
    got = np.asarray(got.astype(jnp.float32))
    want = np.asarray(want.astype(jnp.float32))
    assert got.shape == want.shape
    assert not np.isnan(got).any(), f"NaN in the kernel's output: a stray read ({c.label()})"
    atol, rtol = TOLERANCES[c.dtype]
    err = np.abs(got - want)
    worst = np.unravel_index(np.argmax(err - rtol * np.abs(want)), err.shape)
    assert np.all(err <= atol + rtol * np.abs(want)), (
        f"{c.label()}: max error {err.max():.3g}, worst at {worst}: {got[worst]} vs {want[worst]}")
    assert np.all(got[sum(c.q_lens):] == 0), "padding query rows must come out as zeros"


def random_batches(template: Case, count: int, seed: int = 0) -> list[Case]:
    """Random ragged batches with the template's static shapes (one compile serves them all)."""
    rng = np.random.default_rng(seed)
    max_ctx = template.width * template.block_size
    out = []
    while len(out) < count:
        n = int(rng.integers(1, template.max_seqs + 1))
        q_lens = rng.integers(1, 8, n) * (rng.random(n) < 0.5) + 1      # about half are decodes
        kv_lens = np.minimum(q_lens + rng.integers(0, max_ctx, n), max_ctx)
        pages = sum(-(-int(k) // template.block_size) for k in kv_lens)
        if q_lens.sum() > template.num_tokens or pages > template.num_blocks - 1:
            continue
        out.append(dataclasses.replace(template, q_lens=tuple(int(x) for x in q_lens),
                                       kv_lens=tuple(int(x) for x in kv_lens), seed=seed * 1000 + len(out)))
    return out



# The reference, jitted per static shape: random batches of one shape then reuse one compile.
reference = jax.jit(ragged_paged_attention_reference,
                    static_argnames=("sm_scale", "sliding_window", "soft_cap"))
