"""The fit behind `duet bench front-end`: CPU per engine step and per output from measured batches."""

from __future__ import annotations

import pytest

from duet.benchmarks.front_end_cost import Batch, fit_step_and_output_cost


def _batch(concurrency: int, tokens: int, per_step: float, per_output: float, noise: float = 0.0) -> Batch:
    cpu = tokens * per_step + concurrency * tokens * per_output + noise
    return Batch(concurrency=concurrency, tokens_per_request=tokens, cpu_s=cpu, wall_s=1.0)


def test_the_fit_separates_the_step_cost_from_the_output_cost():
    batches = [_batch(c, 400, 800e-6, 50e-6) for c in (1, 4, 16)]
    per_step, per_output = fit_step_and_output_cost(batches)
    assert per_step == pytest.approx(800e-6, rel=1e-6)
    assert per_output == pytest.approx(50e-6, rel=1e-6)


def test_noise_moves_the_fit_but_not_its_order():
    batches = [_batch(1, 400, 800e-6, 50e-6, +0.02), _batch(4, 400, 800e-6, 50e-6, -0.02), _batch(16, 400, 800e-6, 50e-6)]
    per_step, per_output = fit_step_and_output_cost(batches)
    assert 600e-6 < per_step < 1000e-6
    assert 30e-6 < per_output < 70e-6


def test_a_batch_counts_one_step_per_token_and_one_output_per_request_and_token():
    batch = Batch(concurrency=16, tokens_per_request=400, cpu_s=0.5, wall_s=5.0)
    assert (batch.steps, batch.outputs) == (400, 6400)
