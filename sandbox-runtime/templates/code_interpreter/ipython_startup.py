# Run silently in each Python kernel of the code interpreter (server.py) once
# it starts: matplotlib figures shown inline (png), and two more formats for
# E2B's result fields: `chart` (the data of a matplotlib figure, in the
# shapes the SDKs' Chart types declare) and `data` (a pandas DataFrame as
# columns). Both are registered by type name, so neither pandas nor
# matplotlib is imported until the user's code imports it.
def __sg_setup():
    import math
    from IPython import get_ipython
    from IPython.core.formatters import BaseFormatter
    from traitlets import ObjectName, Unicode

    ip = get_ipython()
    try:
        ip.run_line_magic("matplotlib", "inline")
    except Exception:
        pass

    class _ChartFormatter(BaseFormatter):
        format_type = Unicode("application/vnd.sandgate.chart+json")
        print_method = ObjectName("_repr_sandgate_chart_")
        _return_type = dict

    class _DataFormatter(BaseFormatter):
        format_type = Unicode("application/vnd.sandgate.data+json")
        print_method = ObjectName("_repr_sandgate_data_")
        _return_type = dict

    def num(v):
        try:
            f = float(v)
        except (TypeError, ValueError):
            return str(v)
        return f if math.isfinite(f) else None

    def text(t):
        return t.get_text() if t is not None else ""

    def axis_info(ax):
        return {
            "x_label": ax.get_xlabel() or None, "y_label": ax.get_ylabel() or None,
            "x_unit": None, "y_unit": None,
        }

    def ticks(ax):
        return {
            "x_ticks": [num(v) for v in ax.get_xticks()],
            "x_tick_labels": [text(t) for t in ax.get_xticklabels()],
            "x_scale": ax.get_xscale(),
            "y_ticks": [num(v) for v in ax.get_yticks()],
            "y_tick_labels": [text(t) for t in ax.get_yticklabels()],
            "y_scale": ax.get_yscale(),
        }

    def chart_of_axes(ax):
        from matplotlib.collections import PathCollection
        from matplotlib.patches import Rectangle, Wedge

        title = ax.get_title() or None
        wedges = [p for p in ax.patches if isinstance(p, Wedge)]
        if wedges:
            labels = [text(t) for t in ax.texts]
            elements = []
            for i, w in enumerate(wedges):
                elements.append({"label": w.get_label() if not w.get_label().startswith("_") else
                                 (labels[i] if i < len(labels) else str(i)),
                                 "angle": num(w.theta2 - w.theta1), "radius": num(w.r)})
            return {"type": "pie", "title": title, "elements": elements}
        bars = [p for p in ax.patches if isinstance(p, Rectangle)]
        if bars and not ax.lines:
            elements = []
            labels = [text(t) for t in ax.get_xticklabels()]
            for container in ax.containers:
                group = container.get_label() or ""
                for i, bar in enumerate(container):
                    x = bar.get_x() + bar.get_width() / 2
                    label = labels[i] if i < len(labels) else str(num(x))
                    elements.append({"label": label, "group": group if not group.startswith("_") else "",
                                     "value": num(bar.get_height())})
            return {"type": "bar", "title": title, **axis_info(ax), "elements": elements}
        scatters = [c for c in ax.collections if isinstance(c, PathCollection)]
        if scatters and not ax.lines:
            elements = [{"label": c.get_label() if not c.get_label().startswith("_") else "",
                         "points": [[num(x), num(y)] for x, y in c.get_offsets()]} for c in scatters]
            return {"type": "scatter", "title": title, **axis_info(ax), **ticks(ax), "elements": elements}
        if ax.lines:
            elements = []
            for line in ax.lines:
                xs, ys = line.get_xdata(), line.get_ydata()
                elements.append({"label": line.get_label() if not line.get_label().startswith("_") else "",
                                 "points": [[num(x), num(y)] for x, y in zip(xs, ys)]})
            return {"type": "line", "title": title, **axis_info(ax), **ticks(ax), "elements": elements}
        return {"type": "unknown", "title": title, "elements": []}

    def chart_of_figure(fig):
        axes = [ax for ax in fig.get_axes() if ax.has_data()]
        if not axes:
            return None
        if len(axes) == 1:
            return chart_of_axes(axes[0])
        title = fig._suptitle.get_text() if getattr(fig, "_suptitle", None) else None
        return {"type": "superchart", "title": title, "elements": [chart_of_axes(ax) for ax in axes]}

    def data_of_frame(df):
        try:
            return {"columns": [str(c) for c in df.columns],
                    "data": json_safe(df.head(10000).to_dict(orient="list"))}
        except Exception:
            return None

    def json_safe(v):
        if isinstance(v, dict):
            return {str(k): json_safe(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [json_safe(x) for x in v]
        if isinstance(v, (str, bool)) or v is None:
            return v
        if isinstance(v, (int, float)):
            return num(v) if isinstance(v, float) else v
        try:
            return num(v.item()) if hasattr(v, "item") else str(v)
        except Exception:
            return str(v)

    def guarded(fn):
        def wrapper(obj):
            try:
                return fn(obj)
            except Exception:
                return None
        return wrapper

    # Output is bounded where it is made: past the server's budget a cell's
    # prints are dropped here (one marker says so) instead of piling up in
    # the kernel's stream buffers faster than they can be sent, and past
    # four budgets the cell is stopped with OutputLimitExceeded (a
    # BaseException: `except Exception` does not swallow it).
    import builtins
    import os
    import sys

    limit = int(os.environ.get("SANDGATE_CI_MAX_OUTPUT", str(8 << 20)))

    class OutputLimitExceeded(BaseException):
        pass

    builtins.OutputLimitExceeded = OutputLimitExceeded
    state = {"used": 0, "noted": False}

    def reset(*_):
        state["used"] = 0
        state["noted"] = False

    ip.events.register("pre_run_cell", reset)

    def bounded(stream):
        write = stream.write

        def limited(s):
            n = len(s) if isinstance(s, str) else 0
            state["used"] += n
            if state["used"] <= limit:
                return write(s)
            if not state["noted"]:
                state["noted"] = True
                write(s[: max(0, n - (state["used"] - limit))])  # what fits
                sys.stderr._sg_write(f"\n[sandgate: output truncated: this execution printed more than {limit} "
                                     "bytes; the rest is dropped]\n")
            if state["used"] > 4 * limit:
                raise OutputLimitExceeded(f"this execution printed more than {4 * limit} bytes; it was stopped")
            return n

        stream._sg_write = write
        stream.write = limited

    bounded(sys.stdout)
    bounded(sys.stderr)

    formatters = ip.display_formatter.formatters
    chart = _ChartFormatter(parent=ip.display_formatter)
    chart.for_type_by_name("matplotlib.figure", "Figure", guarded(chart_of_figure))
    formatters[chart.format_type] = chart
    data = _DataFormatter(parent=ip.display_formatter)
    data.for_type_by_name("pandas.core.frame", "DataFrame", guarded(data_of_frame))
    formatters[data.format_type] = data


__sg_setup()
del __sg_setup
