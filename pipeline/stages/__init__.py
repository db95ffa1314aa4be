"""One module per stage; each defines NAME, READS, WRITES, Config and run(ctx, cfg).

Modules are discovered automatically (``pipeline.stage.registry``), so adding a stage means adding
a file here and nothing else.
"""
