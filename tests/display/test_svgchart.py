import re

from htmlq import chart_points

from nblaunch.display.svgchart import line_chart


def coords(svg: str) -> list[list[tuple[float, float]]]:
    lines = re.findall(r'<polyline[^>]* points="([^"]*)"', svg)
    return [[tuple(map(float, p.split(","))) for p in line.split()] for line in lines]


def test_one_polyline_per_series_with_every_point():
    svg = line_chart("loss", [("rank 0", "#111", [(0, 3.0), (1, 2.0), (2, 1.0)]), ("rank 1", "#222", [(0, 2.5), (2, 0.5)])])
    assert chart_points(svg, "loss") == {"rank 0": 3, "rank 1": 2}
    (first, second) = coords(svg)
    assert [x for x, _ in first] == sorted(x for x, _ in first)  # steps go left to right
    assert first[0][1] < first[-1][1]  # a falling loss goes down the page (SVG y grows downwards)
    assert "rank 1" in svg  # a legend, since there are two lines


def test_flat_and_single_point_series_still_draw():
    flat = line_chart("lr", [("rank 0", "#111", [(0, 0.1), (5, 0.1)])])
    assert all(0 <= y <= 190 for line in coords(flat) for _, y in line)
    single = line_chart("lr", [("rank 0", "#111", [(3, 1.0)])])
    assert "<circle" in single


def test_no_points_gives_an_empty_frame_and_names_are_escaped():
    svg = line_chart("<acc>", [("rank 0", "#111", [])])
    assert "<polyline" not in svg and "&lt;acc&gt;" in svg
