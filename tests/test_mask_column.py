"""The dataset's mask column: written as JSON text, read back from text or an Arrow struct,
validated against the sample's length with errors naming the sample and the slice; the trainer's
column reader counts targets and fingerprints data with it."""

import json

import pytest

from hf_cp.samples.mask_column import MASK_COLUMN, decode_mask, decode_mask_column, encode_mask
from hf_cp.samples.masks import AttnSlice, MaskError, SampleMask
from hf_cp.train.data.columns import read_token_columns

MASKS = [
    SampleMask.shared_prompt(3, [2, 4]),
    SampleMask.sliding_window(9, 4),
    SampleMask.prefix_lm(9, 3),
    SampleMask.block_causal(9, 2),
    SampleMask.from_slices(9, [AttnSlice(0, 9, 0, 9, "causal")]),
]


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m.kind)
def test_round_trip_through_text_and_through_a_saved_dataset(tmp_path, mask):
    from datasets import Dataset, load_from_disk

    text = encode_mask(mask)
    assert decode_mask(text, 0, mask.length) == mask
    rows = [
        {"input_ids": list(range(mask.length)), MASK_COLUMN: text},
        {"input_ids": [1, 2, 3], MASK_COLUMN: None},
    ]
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    back = load_from_disk(str(tmp_path / "ds"))
    assert decode_mask_column(back[MASK_COLUMN], [mask.length, 3]) == {0: mask}


def test_causal_masks_need_no_data_and_struct_rows_read_too():
    assert encode_mask(None) is None and encode_mask(SampleMask.causal(5)) is None
    assert decode_mask(None, 0, 5) is None and decode_mask("", 0, 5) is None
    assert decode_mask(json.dumps({"kind": "causal", "length": 5}), 0, 5) is None
    assert decode_mask(encode_mask(SampleMask.sliding_window(5, 9)), 0, 5) is None  # window >= length
    # an Arrow struct column fills keys a row lacks with null
    struct_row = {"kind": "shared_prompt", "length": 6, "prompt": 2, "answers": [1, 3], "window": None, "prefix": None}
    assert decode_mask(struct_row, 0, 6) == SampleMask.shared_prompt(2, [1, 3])


@pytest.mark.parametrize(
    "value, length, message",
    [
        ("{not json", 5, r"sample 7 of ds: column 'attn_mask' is not JSON"),
        ("[1, 2]", 5, r"sample 7 of ds: column 'attn_mask' must hold a mask object"),
        (
            encode_mask(SampleMask.shared_prompt(2, [1, 2])),
            6,
            r"sample 7 of ds: the mask covers 5 tokens but the sample has 6",
        ),
        ('{"kind": "wavy", "length": 5}', 5, r"sample 7 of ds: unknown mask kind 'wavy'"),
        (
            json.dumps({"kind": "slices", "length": 4, "slices": [[0, 4, 0, 4, "causal"], [2, 4, 0, 2, "full"]]}),
            4,
            r"sample 7 of ds: slices 0 \[0, 4, 0, 4, 'causal'\] and 1 \[2, 4, 0, 2, 'full'\] both attend",
        ),
        (
            json.dumps({"kind": "slices", "length": 4, "slices": [[0, 4, 0, 5, "full"]]}),
            4,
            r"sample 7 of ds, slice 0 \[0, 4, 0, 5, 'full'\]: ranges must be non-empty and inside",
        ),
    ],
)
def test_malformed_masks_name_the_sample_and_the_slice(value, length, message):
    with pytest.raises(MaskError, match=message):
        decode_mask_column([None] * 7 + [value], [5] * 7 + [length], "ds")


def test_trainer_columns_read_masks_count_targets_and_fingerprint_them():
    from datasets import Dataset

    m = SampleMask.shared_prompt(3, [2, 4])
    ids = [5, 6, 7, 10, 11, 20, 21, 22, 23]
    labels = [-100, -100, -100] + ids[3:]
    no_prompt = SampleMask.shared_prompt(0, [2, 3])  # two independent sequences in one sample
    rows = [
        {"input_ids": ids, "labels": labels, MASK_COLUMN: encode_mask(m)},
        {"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3, 4], MASK_COLUMN: None},
        {"input_ids": [1, 2, 3, 4, 5], "labels": [1, 2, 3, 4, 5], MASK_COLUMN: encode_mask(no_prompt)},
    ]
    cols = read_token_columns(Dataset.from_list(rows))
    assert cols.masks == {0: m, 2: no_prompt} and cols.lengths == [9, 4, 5]
    # sample 0: answer 1 (7 -> 10, 10 -> 11), answer 2 (7 -> 20 and three more); sample 2: 1 + 2
    assert cols.valid_counts.tolist() == [6, 3, 3]
    plain = read_token_columns(Dataset.from_list([{k: v for k, v in r.items() if k != MASK_COLUMN} for r in rows]))
    assert plain.valid_counts.tolist() == [6, 3, 4]  # causal: 2 -> 3 would cross the two sequences
    assert plain.digest() != cols.digest()
    other = dict(rows[0], **{MASK_COLUMN: encode_mask(SampleMask.shared_prompt(3, [3, 3]))})
    assert read_token_columns(Dataset.from_list([other] + rows[1:])).digest() != cols.digest()
    # mask-free data keeps the digest it had before masks existed
    nulls = read_token_columns(Dataset.from_list([dict(r, **{MASK_COLUMN: None}) for r in rows]))
    assert nulls.digest() == plain.digest()


def test_trainer_refuses_a_malformed_mask_naming_the_sample():
    from datasets import Dataset

    rows = [
        {"input_ids": [1, 2, 3], MASK_COLUMN: None},
        {"input_ids": [1, 2, 3, 4], MASK_COLUMN: '{"kind": "prefix_lm"}'},
    ]
    with pytest.raises(ValueError, match=r"sample 1 of train_dataset: mask kind 'prefix_lm' needs 'length'"):
        read_token_columns(Dataset.from_list(rows))
