// Package log carries a *slog.Logger in a context.Context.
package log

import (
	"context"
	"io"
	"log/slog"
)

type key struct{}

// With returns ctx carrying l.
func With(ctx context.Context, l *slog.Logger) context.Context {
	return context.WithValue(ctx, key{}, l)
}

// From returns the logger in ctx, or one that discards everything.
func From(ctx context.Context) *slog.Logger {
	if l, ok := ctx.Value(key{}).(*slog.Logger); ok {
		return l
	}
	return discard
}

var discard = slog.New(slog.NewTextHandler(io.Discard, nil))
