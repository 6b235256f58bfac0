"""The rlkit-textarena plugin on the real textarena 0.7.4: GuessTheNumber-v0 as a multi-turn environment,
offline."""

from __future__ import annotations

from rlkit.plugin.registry import build_registries
from rlkit.recipe.compose import resolve
from rlkit.testing import check_environment


def test_a_game_passes_the_conformance_check():
    seen = check_environment(
        "textarena", answers=["[10]", "[15]", "[5]", "[12]"], max_turns=12, size=3, val_size=1
    )
    assert seen["rows"] == 3 and all(1 <= t <= 12 for t in seen["turns"])
    assert all(0.0 <= s <= 1.0 for s in seen["scores"])


def test_an_episode_replies_with_the_games_new_lines_and_rewards_a_win():
    from rlkit.data.environment import build_environment

    registries = build_registries()
    env, problems = resolve(
        "data.environment", "environments", {"name": "textarena", "size": 1, "val_size": 0}, registries
    )
    assert not problems
    game = build_environment(env)
    row = game.rows("train")[0]
    assert "Guess The Number" in row["prompt"][0]["content"] and row["extra_info"]["seed"] == 1
    # bisection over 1..20 with the game's hints wins within 5 guesses
    episode, low, high = game.episode(row["extra_info"]), 1, 20
    for _ in range(6):
        guess = (low + high) // 2
        reply, done = episode.step(f"[{guess}]")
        if done:
            break
        assert "[Player]" not in reply and ("higher" in reply or "lower" in reply), reply
        low, high = (guess + 1, high) if "higher" in reply else (low, guess - 1)
    assert done and episode.reward()["won"] == 1.0 and episode.reward()["score"] == 1.0
    unfinished = game.episode(row["extra_info"])
    assert unfinished.reward() == {"score": 0.0, "won": 0.0, "finished": 0.0}  # cut by rlkit's limits
