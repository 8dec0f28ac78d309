"""Timeline hooks. The background thread and the controller report what
happens to each tensor through this interface; `NullTimeline` ignores it."""


class NullTimeline:
    enabled = False

    def negotiate_start(self, name, op, request):
        pass

    def negotiate_rank_ready(self, name, rank, submit_time):
        pass

    def negotiate_end(self, name):
        pass

    def activity_start(self, names, activity):
        pass

    def activity_end(self, names):
        pass

    def mark_cycle(self):
        pass

    def close(self):
        pass
