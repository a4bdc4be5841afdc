"""A version's description fits the MLflow UI's limit and says where the whole card is."""

from tasks.registry.model_card import short_description


def test_the_short_description_points_at_the_card_and_fits_postgres() -> None:
    text = short_description("GRPO gained 8 points.", "grpoflow-demo", "3")
    assert text.startswith("GRPO gained 8 points.") and "models:/grpoflow-demo/3" in text
    assert len(short_description("x" * 9000, "m", "1")) == 5000
