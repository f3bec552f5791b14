"""What the LoRA resume tests share (tests/distributed/test_lora_relayout.py, test_lora_base.py): one run's ranks
merged, and a resumed run held to the run that wrote its checkpoint."""
import torch


def merged(ranks):
    """One run's per-rank results: every rank's losses, the first rank's start, the full weights of all ranks."""
    state = {}
    for r in ranks:
        state.update(r["state"])
    return {"all_losses": [r["losses"] for r in ranks], "start": ranks[0]["start"], "state": state}


def assert_continues(reference, resumed, start: int = 3):
    """`resumed` (from step `start`) gives steps start+1.. of `reference` on every rank (fp32 tolerance) and its final
    weights: the adapters at that tolerance, every other (frozen) tensor bit for bit."""
    assert resumed["start"] == start
    expected = torch.tensor(reference["all_losses"][0][start:], dtype=torch.float32)
    assert len(set(expected.tolist())) == len(expected), "the reference does not train"
    for losses in resumed["all_losses"]:
        torch.testing.assert_close(torch.tensor(losses, dtype=torch.float32), expected)
    assert resumed["state"].keys() == reference["state"].keys()
    for key, value in reference["state"].items():
        assert resumed["state"][key].shape == value.shape, key
        if not key.endswith(("lora_A", "lora_B")):                 # the frozen base: as it was
            assert torch.equal(resumed["state"][key], value), key
        torch.testing.assert_close(resumed["state"][key], value, msg=lambda m: f"{key}: {m}")
