"""Offline, the Fashion-MNIST error lists each file once and says once what to do."""

import pytest

from utils import data


def test_the_offline_error_has_no_repeated_line(tmp_path):
    with pytest.raises(data.DatasetUnavailable) as e:
        data.load_fashion_mnist(root=tmp_path, download=False)
    lines = str(e.value).splitlines()
    repeated = sorted({line for line in lines if lines.count(line) > 1})
    assert not repeated, "repeated lines:\n" + "\n".join(repeated)
    for f in data.FASHION_MNIST_FILES:
        assert sum(f.name in line and f.md5 in line for line in lines) == 1, f.name
    assert sum("place them in" in line for line in lines) == 1
