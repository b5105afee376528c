"""How many REST connections the descriptor limit leaves room for."""

from __future__ import annotations

import pytest

from agent.edge.descriptors import DescriptorBudget, descriptor_budget, soft_limit
from agent.errors import StartupError


def test_the_bound_is_the_asked_one_when_the_limit_has_room() -> None:
    assert descriptor_budget(1024, 256, limit=8192) == DescriptorBudget(8192, 256, 1024, 1024)


def test_a_small_limit_lowers_the_bound_below_it_by_the_reserve() -> None:
    budget = descriptor_budget(1024, 256, limit=1024)
    assert budget.max_connections == 768
    assert budget.lowered


def test_no_room_for_clients_is_a_startup_error_that_says_what_to_raise() -> None:
    with pytest.raises(StartupError, match=r"descriptor limit is 200 .*raise the limit"):
        descriptor_budget(1024, 256, limit=200)


def test_the_soft_limit_of_this_process_is_read() -> None:
    assert soft_limit() > 16


def test_the_engine_socket_takes_two_descriptors_per_connection_from_rest() -> None:
    budget = descriptor_budget(1024, 256, limit=1024, engine_connections=128)
    assert budget.max_connections == 1024 - 256 - 2 * 128
    assert budget.reserved == 256 + 2 * 128
    with pytest.raises(StartupError, match=r"and 512 for the engine socket \(--engine-conn"):
        descriptor_budget(1024, 256, limit=780, engine_connections=256)
