import pytest

from utils import config


def test_profiles_have_every_size():
    for name in config.PROFILE_NAMES:
        cfg = config.profile(name)
        assert set(cfg.keys()) == set(config.TABLE), "every row of TABLE needs a value per profile"


def test_unknown_profile_lists_valid_ones(monkeypatch):
    with pytest.raises(config.UnknownProfileError, match="smoke, cpu, gpu"):
        config.profile("fast")
    monkeypatch.setenv("LAB_PROFILE", "turbo")
    with pytest.raises(config.UnknownProfileError, match="LAB_PROFILE"):
        config.profile()


def test_env_selects_profile(monkeypatch):
    monkeypatch.setenv("LAB_PROFILE", "CPU")
    assert config.profile().name == "cpu"
    monkeypatch.delenv("LAB_PROFILE")
    import torch

    assert config.default_profile_name() == ("gpu" if torch.cuda.is_available() else "cpu")


def test_unknown_size_is_an_error_naming_the_table():
    cfg = config.profile("smoke")
    with pytest.raises(KeyError, match="TABLE"):
        _ = cfg.no_such_size
    with pytest.raises(KeyError, match="unknown size"):
        config.profile("smoke", no_such_size=1)


def test_overrides_and_summary():
    cfg = config.profile("smoke", epochs=1)
    assert cfg.epochs == 1 and cfg["epochs"] == 1
    text = cfg.summary(["epochs", "dataset"])
    assert "profile: smoke" in text and "epochs" in text and "digits" in text
