"""algorithms/turns.py: per-turn credit on the model-token subsequence, against hand-worked examples."""

import pytest
import torch

from streamrft.algorithms.turns import expand_to_response, turn_end_indices, turn_token_rewards


def test_turn_ends_are_subsequence_indices_of_each_turns_last_model_token():
    # response: model 3 | obs 2 | model 2 | obs 4 | model 1   (turn starts at 0, 5, 11)
    mask = torch.tensor([1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0, 1])
    assert turn_end_indices([0, 5, 11], mask) == [2, 4, 5]
    rewards = turn_token_rewards([0.5, -1.0, 2.0], [2, 4, 5], 6)
    assert rewards.tolist() == [0.0, 0.0, 0.5, 0.0, -1.0, 2.0]
    # two turns ending on one index add up (an empty model turn shares its predecessor's end)
    assert turn_token_rewards([1.0, 2.0], [1, 1], 3).tolist() == [0.0, 3.0, 0.0]


def test_expand_puts_values_back_at_the_model_positions_and_zeros_elsewhere():
    mask = torch.tensor([1, 0, 0, 1, 1, 0])
    assert expand_to_response(torch.tensor([1.5, 2.5, 3.5]), mask).tolist() == [1.5, 0.0, 0.0, 2.5, 3.5, 0.0]


def test_inconsistent_turn_data_is_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"turn_starts \[0, 9\] do not fit a response of 4 tokens"):
        turn_end_indices([0, 9], torch.ones(4))
    with pytest.raises(ValueError, match="3 turn rewards for 2 turns"):
        turn_token_rewards([1.0, 2.0, 3.0], [0, 1], 2)
    with pytest.raises(ValueError, match="turn end 5 outside the 3 model tokens"):
        turn_token_rewards([1.0], [5], 3)
    with pytest.raises(ValueError, match="2 values for 3 model tokens"):
        expand_to_response(torch.ones(2), torch.tensor([1, 1, 1, 0]))
