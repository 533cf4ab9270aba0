//! Line charts written as PNG and SVG (plotters, with an embedded DejaVu Sans so no system font
//! library is needed). Suites describe a chart as data (`Chart`); this module only draws it.

use plotters::prelude::*;
use std::path::{Path, PathBuf};

static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

/// One line of a chart.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    /// Index into the palette; series sharing a colour (a measurement and its budget) share it.
    pub colour: usize,
    /// Dashed lines are budgets/limits, solid lines are measurements.
    pub dashed: bool,
}

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub log_y: bool,
    pub series: Vec<Series>,
    /// Optional shaded horizontal band (low, high), e.g. a confidence interval.
    pub band: Option<(f64, f64)>,
    /// Points marked and labelled (a tap over its budget, named).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub markers: Vec<Marker>,
    /// Small multiples: the series sharing a colour (a measurement, its budget) get a panel of
    /// their own, titled by the first solid one, all panels on one scale.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub panels: bool,
}

/// A point drawn as a red dot with its label beside it.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Marker {
    pub x: f64,
    pub y: f64,
    pub label: String,
}

fn register_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // The font is a compile-time asset; a parse failure would be a build defect, and the
        // charts then fall back to no text rather than failing the run.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    });
}

/// Twenty distinguishable colours (the "tab20" ordering: dark then light of each hue).
const PALETTE: [RGBColor; 20] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
    RGBColor(174, 199, 232),
    RGBColor(255, 187, 120),
    RGBColor(152, 223, 138),
    RGBColor(255, 152, 150),
    RGBColor(197, 176, 213),
    RGBColor(196, 156, 148),
    RGBColor(247, 182, 210),
    RGBColor(0, 0, 0),
    RGBColor(219, 219, 141),
    RGBColor(158, 218, 229),
];

fn colour(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

fn draw_err(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(format!("plot: {e}"))
}

/// The largest magnitude a chart draws: a point beyond it (or not finite, or not positive on a
/// log axis) is left out of the drawing — report.json keeps it — since an axis spanning
/// +-1e308 overflows to an infinite range, on which plotters' ticks never end.
const PLOT_LIMIT: f64 = 1e30;

fn plottable(c: &Chart, (x, y): &(f64, f64)) -> bool {
    x.abs() <= PLOT_LIMIT && y.abs() <= PLOT_LIMIT && (!c.log_y || *y > 0.0)
}

/// The axes' ranges (x0, x1, y0, y1) over every plottable point, the markers and the band, with
/// room around them (a factor of two on a log axis, 8% on a linear one).
fn axis_ranges(c: &Chart, marked: &[(f64, f64)], band: Option<(f64, f64)>) -> (f64, f64, f64, f64) {
    let pts = c.series.iter().flat_map(|s| s.points.iter()).chain(marked).filter(|p| plottable(c, p));
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for (x, y) in pts {
        x0 = x0.min(*x);
        x1 = x1.max(*x);
        y0 = y0.min(*y);
        y1 = y1.max(*y);
    }
    if let Some((lo, hi)) = band {
        y0 = y0.min(lo);
        y1 = y1.max(hi);
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 1e-9, 1.0);
    }
    if x1 - x0 < 1e-12 {
        x1 = x0 + 1.0;
    }
    if c.log_y {
        y0 = y0.max(1e-30) / 2.0;
        y1 = (y1 * 2.0).max(y0 * 10.0);
    } else {
        let pad = ((y1 - y0) * 0.08).max(1e-12);
        (y0, y1) = (y0 - pad, y1 + pad);
    }
    (x0, x1, y0, y1)
}

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, plotters::coord::Shift>, c: &Chart) -> std::io::Result<()>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(draw_err)?;
    // The legend gets its own column on the right so it never hides data, as wide as its
    // longest name needs (within a third of the picture).
    let (width, _) = root.dim_in_pixel();
    let longest = c.series.iter().filter_map(|s| root.estimate_text_size(&s.name, &("sans-serif", 13).into_text_style(&root)).ok()).map(|(w, _)| w).max().unwrap_or(0);
    let legend_width = (longest + 48).clamp(230, width / 3);
    let (root, legend) = root.split_horizontally(width.saturating_sub(legend_width));
    let mut y = 50;
    for s in c.series.iter().filter(|s| !s.dashed) {
        let col = colour(s.colour);
        legend.draw(&PathElement::new(vec![(5, y), (30, y)], col.stroke_width(3))).map_err(draw_err)?;
        legend.draw(&Text::new(s.name.clone(), (36, y - 7), ("sans-serif", 13))).map_err(draw_err)?;
        y += 18;
    }
    // Dashed series with a colour of their own (a threshold) get their own legend entry; dashed
    // series sharing a measurement's colour are that measurement's budget.
    let solid_colours: Vec<usize> = c.series.iter().filter(|s| !s.dashed).map(|s| s.colour).collect();
    let mut own: Vec<&Series> = Vec::new();
    for s in c.series.iter().filter(|s| s.dashed && !solid_colours.contains(&s.colour)) {
        if !own.iter().any(|o| o.colour == s.colour) {
            own.push(s);
        }
    }
    for s in own {
        let col = colour(s.colour);
        legend.draw(&PathElement::new(vec![(5, y), (13, y)], col.stroke_width(2))).map_err(draw_err)?;
        legend.draw(&PathElement::new(vec![(20, y), (28, y)], col.stroke_width(2))).map_err(draw_err)?;
        legend.draw(&Text::new(s.name.clone(), (36, y - 7), ("sans-serif", 13))).map_err(draw_err)?;
        y += 18;
    }
    if c.series.iter().any(|s| s.dashed && solid_colours.contains(&s.colour)) {
        let grey = RGBColor(90, 90, 90);
        legend.draw(&PathElement::new(vec![(5, y + 6), (12, y + 6)], grey.stroke_width(1))).map_err(draw_err)?;
        legend.draw(&PathElement::new(vec![(17, y + 6), (24, y + 6)], grey.stroke_width(1))).map_err(draw_err)?;
        legend.draw(&Text::new("dashed: budget (same colour)", (30, y - 1), ("sans-serif", 12))).map_err(draw_err)?;
    }
    let marked: Vec<(f64, f64)> = c.markers.iter().map(|m| (m.x, m.y)).collect();
    let band = c.band.filter(|(lo, hi)| plottable(c, &(0.0, *lo)) && plottable(c, &(0.0, *hi)));
    let (x0, x1, y0, y1) = axis_ranges(c, &marked, band);
    // Layers, positions and pairs are whole numbers: label whole numbers only, at most 12.
    let whole_x = c.series.iter().flat_map(|s| s.points.iter()).filter(|p| plottable(c, p)).all(|(x, _)| x.fract() == 0.0);
    let x_labels = if whole_x { ((x1 - x0) as usize + 1).min(12) } else { 10 };
    let mut builder = ChartBuilder::on(&root);
    builder.caption(&c.title, ("sans-serif", 22)).margin(12).x_label_area_size(40).y_label_area_size(80);
    macro_rules! body {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc(&c.x_label)
                .y_desc(&c.y_label)
                .label_style(("sans-serif", 14))
                .x_labels(x_labels)
                .x_label_formatter(&|v: &f64| if v.fract() == 0.0 { format!("{v:.0}") } else if whole_x { String::new() } else { format!("{v:.2}") })
                .y_label_formatter(&|v: &f64| if c.log_y || v.abs() < 1e-3 && *v != 0.0 { format!("{v:.0e}") } else if v.fract() == 0.0 { format!("{v:.0}") } else { format!("{v:.2}") })
                .draw()
                .map_err(draw_err)?;
            if let Some((lo, hi)) = band {
                chart.draw_series(std::iter::once(Rectangle::new([(x0, lo), (x1, hi)], RGBColor(31, 119, 180).mix(0.15).filled()))).map_err(draw_err)?;
            }
            for s in &c.series {
                let col = colour(s.colour);
                let points: Vec<(f64, f64)> = s.points.iter().copied().filter(|p| plottable(c, p)).collect();
                let style = ShapeStyle { color: col.to_rgba(), filled: false, stroke_width: if s.dashed { 1 } else { 2 } };
                if s.dashed {
                    chart.draw_series(DashedLineSeries::new(points, 6, 4, style)).map_err(draw_err)?;
                } else {
                    chart.draw_series(LineSeries::new(points, style)).map_err(draw_err)?;
                }
            }
            let red = RGBColor(214, 39, 40);
            let marks = c.markers.iter().filter(|m| plottable(c, &(m.x, m.y)));
            chart
                .draw_series(marks.map(|m| EmptyElement::at((m.x, m.y)) + Circle::new((0, 0), 5, red.filled()) + Text::new(m.label.clone(), (7, -16), ("sans-serif", 12))))
                .map_err(draw_err)?;
        }};
    }
    if c.log_y {
        body!(builder.build_cartesian_2d(x0..x1, (y0..y1).log_scale()).map_err(draw_err)?);
    } else {
        body!(builder.build_cartesian_2d(x0..x1, y0..y1).map_err(draw_err)?);
    }
    root.present().map_err(draw_err)?;
    Ok(())
}

/// The series of each panel: grouped by colour, in the order their colours first appear, each
/// group titled by its first solid series (groups with no solid series are not drawn).
fn panel_groups(c: &Chart) -> Vec<(String, Vec<&Series>)> {
    let mut groups: Vec<(usize, Vec<&Series>)> = Vec::new();
    for s in &c.series {
        match groups.iter_mut().find(|(colour, _)| *colour == s.colour) {
            Some((_, g)) => g.push(s),
            None => groups.push((s.colour, vec![s])),
        }
    }
    groups.into_iter().filter_map(|(_, g)| Some((g.iter().find(|s| !s.dashed)?.name.clone(), g))).collect()
}

/// Small multiples: a panel per group of [`panel_groups`], a shared log or linear y range, the
/// first solid line of each panel blue, a second (a reference run) green, dashed lines (budgets)
/// red; one legend line under the title says so.
fn draw_panels<DB: DrawingBackend>(root: DrawingArea<DB, plotters::coord::Shift>, c: &Chart, cols: u32, rows: u32) -> std::io::Result<()>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(draw_err)?;
    let groups = panel_groups(c);
    let (title_area, body) = root.split_vertically(80);
    title_area.draw(&Text::new(c.title.clone(), (20, 10), ("sans-serif", 22))).map_err(draw_err)?;
    let second: Vec<&str> = groups.iter().flat_map(|(_, g)| g.iter().filter(|s| !s.dashed).skip(1).map(|s| s.name.as_str())).collect();
    let mut legend = format!("x: {}; y: {}{}. Blue: measured; red dashed: its budget", c.x_label, c.y_label, if c.log_y { " (log scale, shared)" } else { " (shared)" });
    if let Some(name) = second.first() {
        legend += &format!("; green: {name}");
    }
    title_area.draw(&Text::new(legend, (20, 45), ("sans-serif", 15))).map_err(draw_err)?;
    let (x0, x1, y0, y1) = axis_ranges(c, &[], None);
    let cells = body.split_evenly((rows as usize, cols as usize));
    let (blue, green, red) = (RGBColor(31, 119, 180), RGBColor(44, 160, 44), RGBColor(214, 39, 40));
    for ((title, group), area) in groups.iter().zip(cells) {
        let mut builder = ChartBuilder::on(&area);
        builder.caption(title, ("sans-serif", 15)).margin(8).x_label_area_size(22).y_label_area_size(52);
        macro_rules! body {
            ($chart:expr) => {{
                let mut chart = $chart;
                chart
                    .configure_mesh()
                    .label_style(("sans-serif", 11))
                    .x_labels(((x1 - x0) as usize + 1).min(8))
                    .y_labels(4)
                    .x_label_formatter(&|v: &f64| if v.fract() == 0.0 { format!("{v:.0}") } else { String::new() })
                    .y_label_formatter(&|v: &f64| if c.log_y { format!("{v:.0e}") } else { format!("{v:.2}") })
                    .draw()
                    .map_err(draw_err)?;
                let mut solid = 0;
                for s in group {
                    let points: Vec<(f64, f64)> = s.points.iter().copied().filter(|p| plottable(c, p)).collect();
                    if s.dashed {
                        chart.draw_series(DashedLineSeries::new(points, 5, 3, ShapeStyle { color: red.to_rgba(), filled: false, stroke_width: 1 })).map_err(draw_err)?;
                    } else {
                        // A reference run is drawn thinner, over the measurement, so both show.
                        let (col, width) = if solid == 0 { (blue, 3) } else { (green, 1) };
                        solid += 1;
                        chart.draw_series(LineSeries::new(points, col.stroke_width(width))).map_err(draw_err)?;
                    }
                }
            }};
        }
        if c.log_y {
            body!(builder.build_cartesian_2d(x0..x1, (y0..y1).log_scale()).map_err(draw_err)?);
        } else {
            body!(builder.build_cartesian_2d(x0..x1, y0..y1).map_err(draw_err)?);
        }
    }
    root.present().map_err(draw_err)?;
    Ok(())
}

/// Writes `<stem>.png` and `<stem>.svg` into `dir`; returns both paths. A stem that is not a
/// plain file name (a report.json from elsewhere naming `../../x`) is refused: charts are
/// written inside `dir` only.
pub fn write_chart(dir: &Path, stem: &str, chart: &Chart) -> std::io::Result<Vec<PathBuf>> {
    let plain = !stem.is_empty() && !stem.starts_with('.') && !stem.contains(['/', '\\', '\0', ':']);
    if !plain {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("chart stem `{stem}` is not a plain file name (charts are written inside {} only)", dir.display())));
    }
    register_font();
    std::fs::create_dir_all(dir)?;
    let png = dir.join(format!("{stem}.png"));
    let svg = dir.join(format!("{stem}.svg"));
    if chart.panels {
        let n = panel_groups(chart).len().max(1);
        let cols = (n as f64).sqrt().ceil() as u32;
        let rows = (n as u32).div_ceil(cols);
        let size = (1400, 90 + rows * 250);
        draw_panels(BitMapBackend::new(&png, size).into_drawing_area(), chart, cols, rows)?;
        draw_panels(SVGBackend::new(&svg, size).into_drawing_area(), chart, cols, rows)?;
    } else {
        let size = (1200, 650);
        draw(BitMapBackend::new(&png, size).into_drawing_area(), chart)?;
        draw(SVGBackend::new(&svg, size).into_drawing_area(), chart)?;
    }
    Ok(vec![png, svg])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_png_and_svg_with_text() {
        let dir = tempfile::tempdir().unwrap();
        let chart = Chart {
            title: "error by layer".into(),
            x_label: "layer".into(),
            y_label: "relative RMS error".into(),
            log_y: true,
            series: vec![
                Series { name: "l_out".into(), points: vec![(0.0, 1e-7), (1.0, 3e-7), (2.0, 1e-6)], colour: 0, dashed: false },
                Series { name: "l_out budget".into(), points: vec![(0.0, 1e-5), (2.0, 2e-5)], colour: 0, dashed: true },
            ],
            band: None,
            markers: Vec::new(),
            panels: false,
        };
        let files = write_chart(dir.path(), "layers", &chart).unwrap();
        let png = std::fs::read(&files[0]).unwrap();
        assert_eq!(&png[1..4], b"PNG");
        let svg = std::fs::read_to_string(&files[1]).unwrap();
        assert!(svg.contains("<svg") && svg.contains("l_out") && svg.contains("dashed: budget"), "the SVG carries the legend text");
        // Small multiples: a panel per colour, titled by its measurement.
        let mut panels = chart.clone();
        panels.panels = true;
        panels.series.push(Series { name: "attn_out".into(), points: vec![(0.0, 2e-7), (2.0, 4e-7)], colour: 1, dashed: false });
        let files = write_chart(dir.path(), "panels", &panels).unwrap();
        let svg = std::fs::read_to_string(&files[1]).unwrap();
        assert!(svg.lines().any(|l| l.trim() == "l_out") && svg.lines().any(|l| l.trim() == "attn_out") && svg.contains("red dashed: its budget"), "{svg}");
    }

    /// A chart from a report.json written elsewhere: values at the ends of f64 are left out of
    /// the drawing (an axis of +-1e308 never finished its ticks), and a stem that would write
    /// outside the directory is refused.
    #[test]
    fn hostile_charts_are_drawn_or_refused_never_hang_or_escape() {
        let dir = tempfile::tempdir().unwrap();
        let extreme = vec![(1e308, -1e308), (0.0, 1e308), (-1e308, 1e-308), (1.0, 2.0)];
        for (log_y, panels) in [(false, false), (true, false), (true, true)] {
            let chart = Chart { title: "t".into(), x_label: "x".into(), y_label: "y".into(), log_y, series: vec![Series { name: "s".into(), points: extreme.clone(), colour: 1 << 40, dashed: false }], band: Some((1e308, -1e308)), markers: Vec::new(), panels };
            write_chart(dir.path(), "extreme", &chart).unwrap();
        }
        let chart = Chart { title: "t".into(), x_label: "x".into(), y_label: "y".into(), log_y: false, series: vec![], band: None, markers: Vec::new(), panels: false };
        for stem in ["../x", "a/b", "", ".hidden", "..", "c:\\x"] {
            let e = write_chart(dir.path(), stem, &chart).unwrap_err().to_string();
            assert!(e.contains("is not a plain file name"), "{stem}: {e}");
        }
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2, "only extreme.png and extreme.svg were written");
    }
}
