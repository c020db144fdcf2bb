"""``specserve bench``: speed, losslessness and acceptance of any OpenAI-compatible server.

Method (after the public write-ups in shared/reference): non-streaming requests at
temperature 0, tok/s = ``usage.completion_tokens`` / client wall clock of the request,
median with min and max over prompts x runs, answers hashed so an A/B run is also a
losslessness test, and the server's speculative-decoding counters differenced from
``/metrics`` around each configuration's runs.
"""
