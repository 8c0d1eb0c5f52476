"""Sample masks written as specs, (kind, length, params...), for the block-engine tests' cases."""

from __future__ import annotations

from hf_cp.samples.masks import AttnSlice, SampleMask, SliceKind


def explicit_mask(n):
    """A mask only explicit slices express: rows 0..3 full over themselves, later rows see the
    first two keys and a band of three ending at themselves (bi-causal)."""
    return SampleMask.from_slices(
        n,
        [
            AttnSlice(0, 4, 0, 4, SliceKind.FULL),
            AttnSlice(4, n, 0, 2, SliceKind.FULL),
            AttnSlice(4, n, 2, n, SliceKind.BI_CAUSAL),
        ],
    )


def make_mask(spec):
    """spec: (kind, length, params...) -> SampleMask or None (causal)."""
    kind, n = spec[0], spec[1]
    if kind == "causal":
        return None
    if kind == "sliding_window":
        return SampleMask.sliding_window(n, spec[2])
    if kind == "prefix_lm":
        return SampleMask.prefix_lm(n, spec[2])
    if kind == "block_causal":
        return SampleMask.block_causal(n, spec[2])
    if kind == "shared_prompt":
        return SampleMask.shared_prompt(spec[2], spec[3])
    if kind == "slices":
        return explicit_mask(n)
    raise AssertionError(kind)


def spec_length(spec):
    """The token count of the sample `spec` describes."""
    return spec[2] + sum(spec[3]) if spec[0] == "shared_prompt" else spec[1]
