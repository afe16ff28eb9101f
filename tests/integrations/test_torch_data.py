"""IndexedBatches names each batch of a real DataLoader (shuffled, two worker processes) by its
dataset indices: one sample of the dataset is poisoned with a NaN, and the incident must name the
batch that holds it, as the batch's own contents show."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler

from monitor import TrainerMon
from monitor.integrations.torch_data import IndexedBatches

POISONED, SIZE = 37, 96


class Numbered(Dataset):
    """Sample i is (i, features); sample POISONED has a NaN feature."""

    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, index: int):
        features = torch.full((4,), float(index % 7) / 7)
        if index == POISONED:
            features[0] = float("nan")
        return index, features


def test_the_incident_names_the_batch_holding_the_bad_sample(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    torch.manual_seed(3)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMon({"xy_distribution": True, "all_xy": True, "ops": ["norm"], "format": "api"})
    mon.set_monitor(model, 1, optimizer)
    batches = IndexedBatches(BatchSampler(RandomSampler(range(SIZE)), 8, drop_last=False))
    loader = DataLoader(Numbered(), batch_sampler=batches, num_workers=2)
    seen = []
    for step, (indices, features) in enumerate(batches.named(loader, mon)):
        seen.append(indices.tolist())
        if POISONED in indices.tolist():
            bad_step, bad_batch = step, indices.tolist()
        model(features).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            model.weight.nan_to_num_(0.0)
            model.bias.nan_to_num_(0.0)
    mon.stop()
    assert sorted(i for batch in seen for i in batch) == list(range(SIZE))  # every sample, once
    first = mon.incidents[0]
    assert first.onset_step == bad_step
    assert [entry["ids"] for entry in first.batch_ids] == [bad_batch]


def test_a_loader_of_another_sampler_is_refused():
    batches = IndexedBatches(BatchSampler(range(4), 2, drop_last=False))
    other = DataLoader(range(4), batch_size=2)
    with pytest.raises(ValueError, match="expected a DataLoader built with batch_sampler=this"):
        next(batches.named(other, None))
