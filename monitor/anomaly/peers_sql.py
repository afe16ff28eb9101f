"""The cross-rank outliers as one SQL query, for a run too large for one machine.

``anomaly-analyse --cross-rank`` (monitor.anomaly.peers) judges each rank's value against the
median of the other ranks', in units of a pooled median absolute deviation. ``cross_rank_sql``
writes the same judgement as SQL over a view ``v`` with the dataset's columns (``rank, step,
micro_step, vpp_stage, data_type, name, op, value``): the dataset ``trainmon compact`` writes, or
the files ``format: parquet`` writes, read with their ``data_type=`` partitions. The text runs
unchanged in DuckDB and in Spark SQL (3.4 or later, for ``median``): only window functions,
``CASE`` and ``median``, no engine's own list functions. On the same values it flags the same
values with the same peers' medians, scales and deviations as the command (up to the last bits of
a median that engines interpolate differently), over every step of the run. The value rows
carry no pipeline stage: where a run has several, restrict ``v`` to one stage's ranks, as the
command compares each stage apart.
"""

from __future__ import annotations

from monitor.anomaly.cross_rank import DEFAULT_K_MAD, DEFAULT_OPS, DEFAULT_TYPES
from monitor.anomaly.peers import ABS_FLOOR, MIN_RANKS, OWN_UNITS, REL_FLOOR, USUAL_STEPS

_GROUP = "data_type, vpp_stage, name, micro, step, op"
_JOIN = " AND ".join(f"a.{c} = b.{c}" for c in _GROUP.split(", "))


def cross_rank_sql(
    k_mad: float = DEFAULT_K_MAD,
    types: tuple[str, ...] = tuple(DEFAULT_TYPES.split(",")),
    ops: tuple[str, ...] = tuple(DEFAULT_OPS.split(",")),
) -> str:
    """The query; its rows are the outliers, earliest first, with the columns of the command's
    ``cross_rank_outliers.json`` (``deviation_mads`` NULL for NaN/Inf values).

    Raises:
        ValueError: a type or op that is not a plain name (they are written into the text).
    """
    for name in (*types, *ops):
        if not name.replace("_", "").isalnum():
            raise ValueError(f"expected plain names of data types and ops, got {name!r}")
    listed = ", ".join(f"'{name}'" for name in types), ", ".join(f"'{op}'" for op in ops)
    floors = " ".join(f"WHEN b.op = '{op}' THEN {floor!r}" for op, floor in ABS_FLOOR.items())
    own = ", ".join(f"'{op}'" for op in sorted(OWN_UNITS))
    return f"""
WITH x AS (  -- the values compared; finite ones make a group's medians
    SELECT data_type, vpp_stage, name, coalesce(micro_step, -1) AS micro, step, op, rank, value,
           abs(value) <= 1.7976931348623157e308 AS finite
    FROM v WHERE data_type IN ({listed[0]}) AND op IN ({listed[1]})
),
f AS (
    SELECT *, row_number() OVER (PARTITION BY {_GROUP} ORDER BY value) AS r,
           count(*) OVER (PARTITION BY {_GROUP}) AS n
    FROM x WHERE finite
),
m AS (  -- per tensor, step and op: the order statistics around the middle, the median magnitude
    SELECT {_GROUP}, n,
           max(CASE WHEN r = floor(n / 2) THEN value END) AS lo,
           max(CASE WHEN r = floor(n / 2) + 1 THEN value END) AS mid,
           max(CASE WHEN r = floor(n / 2) + 2 THEN value END) AS hi,
           median(abs(value)) AS size, avg(CASE WHEN value <> 0 THEN abs(value) END) AS magnitude
    FROM f GROUP BY {_GROUP}, n
),
p AS (  -- each value with the median of the other ranks' finite values
    SELECT a.*, b.n, b.size, b.magnitude,
           CASE WHEN NOT a.finite THEN (CASE WHEN b.n % 2 = 0 THEN (b.lo + b.mid) / 2 ELSE b.mid END)
                WHEN b.n % 2 = 0 THEN (CASE WHEN a.value <= b.lo THEN b.mid ELSE b.lo END)
                WHEN a.value = b.mid THEN (b.lo + b.hi) / 2
                WHEN a.value < b.mid THEN (b.mid + b.hi) / 2
                ELSE (b.lo + b.mid) / 2 END AS peers
    FROM x a JOIN m b ON {_JOIN}
),
g AS (  -- the median absolute deviation of each tensor, step and op
    SELECT {_GROUP}, median(abs(value - peers)) AS mad, max(size) AS size, max(n) AS n,
           max(magnitude) AS magnitude
    FROM p WHERE finite GROUP BY {_GROUP}
),
t AS (  -- its typical size relative to the magnitude, over the run: per tensor, and per op;
        -- and its usual magnitude of non-zero values, the unit where most ranks hold 0
    SELECT data_type, vpp_stage, name, op,
           median(CASE WHEN size > 0 AND n >= {MIN_RANKS} THEN mad / size END) AS ratio,
           CASE WHEN count(CASE WHEN n >= {MIN_RANKS} THEN magnitude END) >= {USUAL_STEPS}
                THEN median(CASE WHEN n >= {MIN_RANKS} THEN magnitude END) END AS magnitude
    FROM g GROUP BY data_type, vpp_stage, name, op
),
o AS (
    SELECT data_type, op, median(CASE WHEN size > 0 AND n >= {MIN_RANKS} THEN mad / size END) AS ratio
    FROM g GROUP BY data_type, op
),
s AS (
    SELECT a.*, greatest(b.mad, coalesce(greatest(t.ratio, o.ratio), 0) * b.size, {REL_FLOOR!r} * b.size,
                         CASE {floors} ELSE 0 END,
                         CASE WHEN b.size = 0 AND b.op NOT IN ({own}) THEN coalesce(t.magnitude, 0) ELSE 0 END
                ) AS unit
    FROM p a JOIN g b ON {_JOIN}
    JOIN t ON t.data_type = b.data_type AND t.vpp_stage = b.vpp_stage AND t.name = b.name AND t.op = b.op
    JOIN o ON o.data_type = b.data_type AND o.op = b.op
)
SELECT data_type, rank, step, CASE WHEN micro >= 0 THEN micro END AS micro_step, vpp_stage, name, op, value,
       peers AS peers_median, scale,
       CASE WHEN finite THEN abs(value - peers) / scale END AS deviation_mads
FROM (SELECT *, CASE WHEN unit > 0 THEN unit ELSE 2.2250738585072014e-308 END AS scale FROM s) AS u
WHERE NOT finite OR (n >= {MIN_RANKS} AND abs(value - peers) > {float(k_mad)!r} * scale)
ORDER BY step, micro, data_type, vpp_stage, name, op, rank
"""
