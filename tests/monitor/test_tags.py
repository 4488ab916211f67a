"""Tags, the Custom Scalars layout, and the README's tag table."""

import re
from pathlib import Path

from lightning_cafin.monitor.tags import CAFIN, CHARTS, PRECONDITIONER, custom_scalars_layout, readme_table

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_tag_table_is_the_generated_one():
    assert readme_table() in README.read_text(), "README's tag table is stale: paste monitor.tags.readme_table()"


def test_layout_regexes_match_exactly_their_tag():
    layout = custom_scalars_layout(["", "/opt1"], "fused vs reference")
    assert set(layout) == {CAFIN, PRECONDITIONER}
    tags = [c.tag + s for c in CHARTS for s in ("", "/opt1")]
    for section in layout.values():
        for title, (kind, regexes) in section.items():
            assert kind == "Multiline" and re.search(r"\(.+\)$", title), title  # a unit in every title
            for rx in regexes:
                assert sum(bool(re.match(rx, t)) for t in tags) == 1, rx
    assert any("fused vs reference" in title for title in layout[CAFIN])


def test_tags_are_unique_and_under_cafin():
    assert len({c.tag for c in CHARTS}) == len(CHARTS)
    assert all(c.tag.startswith("cafin/") for c in CHARTS)
