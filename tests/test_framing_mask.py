"""The mask that keeps copies apart from the sender in one forward (``framing.decode.copy_mask``),
as a pure function: who sees whom, written out by hand."""

import torch

from kvcomm_agents.framing.decode import copy_mask


def _visible(mask: torch.Tensor) -> list[list[int]]:
    return (mask == 0).int().tolist()


def test_the_sender_a_reply_copy_and_a_text_copy_each_see_only_what_their_reader_would():
    # cache: the sender's prompt (positions 0-5, context 0), a text copy's prefix (0-2, context 2)
    # queries: a reply copy's lead-in + reply at 4-5 (context 1, reads the sender's first 4
    # positions), the text copy's first text id at 3 (context 2), the sender's token at 6
    key_pos = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2, 4, 5, 3, 6])
    key_ctx = torch.tensor([0, 0, 0, 0, 0, 0, 2, 2, 2, 1, 1, 2, 0])
    q_pos, q_ctx = key_pos[-4:], key_ctx[-4:]
    mask = copy_mask(key_pos, key_ctx, q_pos, q_ctx, keep=[4, 0], dtype=torch.float32)
    assert mask.shape == (4, 13)
    assert _visible(mask) == [
        # sender 0-5 | prefix 0-2 | copy 4 5 | text 3 | sender 6
        [1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0],  # reply copy at 4: the sender's 0-3, itself
        [1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0],  # reply copy at 5: and its id at 4 (causal)
        [0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 1, 0],  # text copy at 3: its reader's prefix only
        [1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1],  # the sender: its own keys only
    ]
    assert float(mask.min()) == torch.finfo(torch.float32).min  # hidden keys get the dtype's minimum


def test_a_copy_reading_the_whole_prompt_still_never_sees_the_senders_later_tokens():
    key_pos = torch.tensor([0, 1, 2, 3, 3])
    key_ctx = torch.tensor([0, 0, 0, 0, 1])  # the sender's token at 3 and a copy's at 3
    mask = copy_mask(key_pos, key_ctx, key_pos[-2:], key_ctx[-2:], keep=[3], dtype=torch.bfloat16)
    assert mask.dtype == torch.bfloat16
    assert _visible(mask) == [[1, 1, 1, 1, 0], [1, 1, 1, 0, 1]]
