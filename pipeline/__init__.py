"""vlpipe: offline vision-language artifact pipeline (stages on Ray, Parquet/WebDataset output)."""

__version__ = "0.1.0"
