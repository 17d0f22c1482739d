"""BERT-like encoder: masking, MLM loss over micro-batches, inputs."""

import pytest
import torch

from twobp.models import build_model, mask_tokens, mlm_loss


def tiny_bert():
    return build_model("bert", "tiny", dtype=torch.float64, n_layers=2)


def test_mask_tokens_masks_a_fixed_count_per_sequence():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (6, 20), generator=gen)
    masked, target = mask_tokens(ids, 3, 99, gen)
    is_masked = target != -100
    assert (is_masked.sum(dim=1) == 3).all()
    assert torch.equal(target[is_masked], ids[is_masked])
    assert (masked[is_masked] == 99).all()
    assert torch.equal(masked[~is_masked], ids[~is_masked])


def test_mask_tokens_rejects_impossible_counts():
    with pytest.raises(ValueError, match="n_masked"):
        mask_tokens(torch.zeros(2, 4, dtype=torch.long), 5, 1, torch.Generator())


def test_example_batch_masks_n_masked_positions_with_the_mask_id():
    spec = tiny_bert()
    ids, target = spec.make_batch(4, 0)
    n_masked = spec.meta["n_masked"]
    assert n_masked == round(0.15 * 32)
    assert ((target != -100).sum(dim=1) == n_masked).all()
    assert (ids[target != -100] == spec.config.mask_token_id).all()
    assert (ids[target == -100] < spec.config.mask_token_id).all()


def test_mean_of_micro_batch_losses_equals_whole_batch_loss():
    spec = tiny_bert()
    model = spec.sequential()
    ids, target = spec.make_batch(6, 1)
    whole = mlm_loss(model(ids), target)
    parts = [mlm_loss(model(i), t) for i, t in zip(ids.chunk(3), target.chunk(3), strict=True)]
    torch.testing.assert_close(torch.stack(parts).mean(), whole)


def test_attention_is_bidirectional():
    spec = tiny_bert()
    model = spec.sequential()
    ids = spec.example_input(2)
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 200
    assert not torch.allclose(model(ids)[:, 0], model(changed)[:, 0])


def test_first_block_accepts_ids_or_ids_and_token_types():
    spec = tiny_bert()
    embed = spec.blocks[0]
    ids = spec.example_input(2)
    zeros = torch.zeros_like(ids)
    torch.testing.assert_close(embed(ids), embed((ids, zeros)))
    assert not torch.allclose(embed(ids), embed((ids, torch.ones_like(ids))))


def test_seq_len_is_bounded_by_positions():
    with pytest.raises(ValueError, match="max_positions"):
        build_model("bert", "tiny", device="meta", seq_len=1024)
