"""`mxlaunch bench`: a load generator for OpenAI-compatible servers (`run`: streaming /v1/completions, TTFT,
ITL, throughput) over a lean asyncio HTTP/1.1 client (`client`). Shares `mxlaunch.http` and the prompt set
with verify; imports no engine."""
