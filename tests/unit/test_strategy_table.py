"""The strategy table: every strategy the config accepts has one row, and each of hybrid
sharding's outer strategies names an ownership."""

from typing import get_args

from rayzero.sharding.config import STRATEGIES as NAMES
from rayzero.sharding.config import ShardingConfig
from rayzero.sharding.strategies import HYBRID_OWNERSHIP, STRATEGIES


def test_every_configurable_strategy_has_one_row():
    assert tuple(STRATEGIES) == NAMES
    assert set(get_args(ShardingConfig.model_fields["strategy"].annotation)) == set(NAMES)
    assert set(HYBRID_OWNERSHIP) == set(get_args(ShardingConfig.model_fields["outer_strategy"].annotation))

