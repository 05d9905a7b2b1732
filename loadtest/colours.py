"""The colour names the demo model learnt (prism/scenes.py draws its training
scenes with them) and their RGB values: the load tester's clips use the same,
so the demo model can say what it sees in them."""

COLOURS = {
    "red": (215, 35, 35),
    "green": (35, 160, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 210, 40),
    "orange": (245, 135, 25),
    "purple": (145, 55, 185),
}
