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


def labels(svg: str) -> list[str]:
    return re.findall(r'text-anchor="end">([^<]*)</text>', svg)


def test_a_loss_spanning_decades_is_drawn_on_a_log_scale_with_labels_at_powers_of_ten():
    svg = line_chart("loss", [("rank 0", "#111", [(step, 2.0 * 0.5**step) for step in range(40)])])
    assert 'data-scale="log"' in svg and "(log scale)" in svg
    assert labels(svg) == ["1e-09", "1e-06", "0.001", "1"]
    (line,) = coords(svg)
    ys = [y for _, y in line]
    steps = [b - a for a, b in zip(ys, ys[1:])]
    assert max(steps) - min(steps) < 0.5  # halving every step: evenly spaced on a log axis


def test_y_labels_fit_left_of_the_plot_and_there_are_more_than_two():
    svg = line_chart("grad", [("rank 0", "#111", [(step, 3.378e-07 + step * 1e-9) for step in range(40)])])
    assert 'data-scale="linear"' in svg
    shown = labels(svg)
    assert len(shown) >= 3 and all("e-07" in label for label in shown)
    left = float(re.search(r'<rect x="([\d.]+)"', svg).group(1))
    assert left >= max(len(label) for label in shown) * 6.2  # the longest label has room: nothing cut
    assert float(re.search(r'<rect x="([\d.]+)"', line_chart("x", [("r", "#1", [(0, 1), (1, 2)])])).group(1)) < left


def test_negative_values_and_a_single_decade_stay_linear():
    assert 'data-scale="linear"' in line_chart("m", [("r", "#1", [(0, -5.0), (1, 50.0)])])
    assert 'data-scale="linear"' in line_chart("m", [("r", "#1", [(0, 1.0), (1, 50.0)])])
