"""A whole pickled module lists the tensors its ``state_dict()`` lists, no more.

An ``nn.LSTM`` keeps ``_flat_weights``, a plain attribute holding references to its own
parameters: pickled through the memo, they are the same objects, not tensors of their own
(issue 18, item 11: 22 tensors listed where torch has 14). The files are written by torch in
tmp_path, in the zip format and the legacy one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import modelsize
from modelsize.categories import Category
from tests.conftest import nbytes

torch = pytest.importorskip("torch")
nn = torch.nn


class _Tagger(nn.Module):
    """An LSTM tagger, as small as one gets."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.lstm = nn.LSTM(8, 16, num_layers=3)
        self.head = nn.Linear(16, 5)


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_lstm_module_lists_its_state_dict(tmp_path: Path, zipped: bool) -> None:
    torch.manual_seed(0)
    model = _Tagger()
    path = tmp_path / "tagger.pt"
    torch.save(model, path, _use_new_zipfile_serialization=zipped)
    state = model.state_dict()

    inv = modelsize.inspect(path).inventory
    assert sorted(t.name for t in inv.tensors) == sorted(state)
    assert len(inv.tensors) == len(state) == 3 + 3 * 4  # embed, head x2, 4 per LSTM layer
    assert inv.bytes_by_category[Category.WEIGHTS] == nbytes(*state.values())
    assert inv.bytes_by_category[Category.ACTIVATIONS] == 0


def test_a_cached_activation_attribute_still_counts(tmp_path: Path) -> None:
    """A module attribute holding a tensor of its own (not a reference to a parameter) stays
    an activation: only second references are skipped."""
    model = _Tagger()
    model.last = torch.zeros(7, 16)
    path = tmp_path / "cached.pt"
    torch.save(model, path)

    inv = modelsize.inspect(path).inventory
    assert {t.name for t in inv.tensors} == {*model.state_dict(), "last"}
    assert inv.bytes_by_category[Category.ACTIVATIONS] == nbytes(model.last)
