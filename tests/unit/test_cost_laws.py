"""Cost laws (harness.backends.cost): fit to their measured points, in words for a SKIPPED reason."""
from __future__ import annotations

import pytest

from harness.backends.cost import AUDIO_SECONDS, EXPORTED_NODES, LSTM_STEPS, CostLaw


def test_a_power_law_is_fit_through_its_points():
    law = CostLaw(EXPORTED_NODES, "s", ((1897, 42.6), (3753, 119.3)))  # tvm-onnx's measured compile
    assert law.estimate(3753) == pytest.approx(119.3, rel=1e-9)
    assert law.estimate(2 * 3753) == pytest.approx(119.3 * 2 ** 1.509, rel=1e-3)
    assert "grows as the exported nodes to the power 1.51 (measured: 42.6 s at 1,897, 119 s at 3,753 exported nodes;" in law.describe()


def test_a_quadratic_law_grows_with_the_square():
    law = CostLaw(LSTM_STEPS, "GB", ((0, 1.0), (100, 2.0), (200, 5.0)), form="quadratic")
    assert law.estimate(300) == pytest.approx(10.0)
    assert law.describe().startswith("grows with the square of the LSTM steps (measured: 1.0 GB at 0, 2.0 GB at 100, 5.0 GB at 200 LSTM steps;")


def test_a_law_without_enough_points_or_with_an_unknown_form_is_an_error():
    with pytest.raises(ValueError, match="a quadratic CostLaw needs 3 points, got 2"):
        CostLaw(AUDIO_SECONDS, "s", ((1, 1), (2, 2)), form="quadratic")
    with pytest.raises(ValueError, match="form 'cubic': power or quadratic"):
        CostLaw(AUDIO_SECONDS, "s", ((1, 1), (2, 2)), form="cubic")
