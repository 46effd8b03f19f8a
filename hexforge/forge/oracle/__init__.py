"""The build's oracle: every target judged against HF (graphs, teacher-forced, greedy, real-text
quality), on the cpu backend the runtime provides."""
