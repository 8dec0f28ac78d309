"""What the iterators here share: standing in for the iterator they wrap."""

import chainer


class IteratorWrapper(chainer.dataset.iterator.Iterator):
    """An iterator whose attributes, other than its own, are those of
    `actual_iterator`: reads and writes go through to it, and so does
    serialization (as ChainerMN's iterators do). Subclasses set their own
    attributes with `object.__setattr__`."""

    def __getattr__(self, name):
        return getattr(self.actual_iterator, name)

    def __setattr__(self, name, value):
        setattr(self.actual_iterator, name, value)

    def serialize(self, serializer):
        self.actual_iterator.serialize(serializer)
