"""Video intake (issue 46): `video_url` parts fetched, judged by their header,
sampled as vLLM's loader samples and decoded, before any model time.

The pipeline calls `VideoIntake.take_all` (gateway/intake/video/intake.py) and gets
one `SampledVideo` (gateway/intake/video/sampling.py) per part.
"""
