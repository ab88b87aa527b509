"""The one vocabulary (`engine_ext.sites`): hooks, site names and indices, keys, and the selector
text the dashboard, the CLI and the docs share. Pure Python: no engine."""

from __future__ import annotations

import pytest

from engine_ext.errors import SpecError
from engine_ext.sites import (HOOKS, SITES_PER_LAYER, Site, SitePosition, format_layers, format_positions, parse_layers,
                              parse_positions, parse_span, site_from_index, site_index, site_name)


def test_site_text_index_and_order():
    assert site_name(3, "post_attn") == str(Site(3, "post_attn")) == "L3.post_attn"
    assert Site.parse(" L3.post_attn ") == Site(3, "post_attn")
    for i in range(4 * SITES_PER_LAYER):
        site = site_from_index(i)
        assert site.index() == site_index(site.layer, site.hook) == i
    assert [site_from_index(i).hook for i in range(SITES_PER_LAYER)] == list(HOOKS)
    assert sorted([Site(1, "post_block"), Site(1, "pre_attn"), Site(0, "post_attn")], key=lambda s: s.sort_key) == [
        Site(0, "post_attn"), Site(1, "pre_attn"), Site(1, "post_block")]
    key = SitePosition(2, "pre_attn", 5)
    assert key == (2, "pre_attn", 5) and key.layer == 2 and key.position == 5
    for bad in ("L3.mlp_up", "3.post_block", "L-1.pre_attn", "L3"):
        with pytest.raises(SpecError):
            Site.parse(bad)
    with pytest.raises(SpecError) as info:
        Site(-1, "pre_attn")
    assert info.value.field == "layer"


def test_layer_selectors():
    assert parse_layers("all") is None and parse_layers(" ") is None
    assert parse_layers("0-2, 5") == [0, 1, 2, 5]
    assert parse_layers("4,1,1") == [1, 4]
    assert parse_layers("0:6:2") == [0, 2, 4] and parse_layers(":3") == [0, 1, 2] and parse_layers("0:6") == list(range(6))
    assert parse_layers("1-2,6:8") == [1, 2, 6, 7]
    for text in ("3-1", "x", "1,,2", "5:2", "1:2:3:4", "0:", "-1", "1:4:0"):
        with pytest.raises(SpecError) as info:
            parse_layers(text, "sweep.layers")
        assert info.value.field == "sweep.layers"
    for layers in ([0, 1, 2, 5], [3], [0, 2, 4], None):
        assert parse_layers(format_layers(layers)) == layers
    assert format_layers([0, 1, 2, 5]) == "0-2,5"


def test_position_selectors():
    assert parse_positions("all") == "all_prompt" and parse_positions("all_prompt") == "all_prompt" and parse_positions("") == "all_prompt"
    assert parse_positions("1-3, span:Tarn Vale#1, 7") == [1, 2, 3, {"span": "Tarn Vale", "occurrence": 1}, 7]
    assert parse_positions("span: is") == [{"span": " is", "occurrence": 0}]  # the span text is verbatim
    assert parse_positions("-1,0:2") == [-1, 0, 1]
    assert parse_positions("span:a#b") == [{"span": "a#b", "occurrence": 0}]  # '#' + non-digits is text
    for text in ("span:", "one", "2-", "all_prompt,3", "span:#2"):
        with pytest.raises(SpecError) as info:
            parse_positions(text)
        assert info.value.field == "positions"
    for pos in ([1, 2, 3, {"span": "Tarn Vale", "occurrence": 1}], [4], "all_prompt", [{"span": "x", "occurrence": 0}]):
        assert parse_positions(format_positions(pos)) == pos


def test_span_text():
    assert parse_span("Garrow") == {"span": "Garrow", "occurrence": 0}
    assert parse_span("the#2") == {"span": "the", "occurrence": 2}
    with pytest.raises(SpecError) as info:
        parse_span("#1", "subject")
    assert info.value.field == "subject"
