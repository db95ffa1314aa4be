"""`pipeline report`: a static HTML report of a run, with the pictures each artifact calls for.

``build_report(output)`` reads every artifact found under a run's output folder and writes
``<output>/report/index.html`` with its images beside it in ``<output>/report/img/``: no server,
no network, no script; it opens from the file system. Sections:

- run overview: one row per stage (artifact, rows, shards, errors, wall time), models with
  RANDOM WEIGHTS flagged at the top of the page;
- per stage: tables and shards, errors by reason with examples (sample id, detail), worker
  timings, models, parameters; a missing artifact says what is missing and the command that
  makes it;
- ``samples``: a few images with their first caption;
- ``concepts``: the most frequent concepts per n, a few concepts with thumbnails of their images
  and their hard negatives;
- ``negatives``: captions with the replaced noun highlighted and its top candidates (p, q, score);
- ``visual_tokens``: masks, triplets as labelled arrows between mask centres, the rank matrix;
- ``clip_tokens``: text tokens per caption;
- ``image_groups``: the soft group assignment drawn over the image;
- ``regions``: top boxes with scores and labels;
- ``index``: for a few queries, the nearest cross-modal hard negatives (thumbnails, captions);
- training runs under ``<output>/train/<job>/``: curves (:mod:`pipeline.report.curves`), evaluation tables
  with chance (``eval/<step>/results.parquet``, else ``eval/<step>/metrics.json``), the job's own
  figures.

The page is a Jinja2 template (``templates/report.html.j2``); figures are matplotlib
(:mod:`pipeline.report.figures`); the data of each section is gathered in
:mod:`pipeline.report.build`.
"""

from pipeline.report.build import SECTION_IDS, build_report

__all__ = ["build_report", "SECTION_IDS"]
