package worker

import (
	"encoding/json"
	"net/http"
	"time"

	"github.com/dsec-project/dsec/api"
)

// none is a request without a body, or an answer without one (204 No
// Content).
type none struct{}

// created is an answer for a request that made something (201 Created).
type created[T any] struct{ v T }

func (c created[T]) body() any { return c.v }

// handle adapts a typed handler to HTTP: the request's body decoded
// into Req (JSON of at most 1 MiB, no unknown fields; none reads
// nothing), the answer encoded as JSON (none: 204; created: 201), and
// an error answered with its class's status and body (api.ErrorOf): the
// one place the worker's plain calls are answered. Streaming calls
// (exec, logs, files, calls) answer themselves.
func handle[Req, Resp any](fn func(r *http.Request, req Req) (Resp, error)) http.HandlerFunc {
	return func(rw http.ResponseWriter, r *http.Request) {
		var req Req
		if _, empty := any(req).(none); !empty {
			done := readBy(rw)
			err := decode(r, &req)
			done()
			if err != nil {
				fail(rw, err)
				return
			}
		}
		resp, err := fn(r, req)
		if err != nil {
			fail(rw, err)
			return
		}
		switch v := any(resp).(type) {
		case none:
			rw.WriteHeader(http.StatusNoContent)
		case interface{ body() any }:
			answer(rw, http.StatusCreated, v.body())
		default:
			answer(rw, http.StatusOK, resp)
		}
	}
}

// bodyTimeout is how long a request's JSON (or a stream's first line)
// may take to come: a client that sends it slowly holds its slot no
// longer.
const bodyTimeout = 30 * time.Second

// readBy bounds the reading of a request's JSON in time; the returned
// func lifts the bound once it is read (a stream's stdin, which
// follows, takes its time).
func readBy(rw http.ResponseWriter) func() {
	rc := http.NewResponseController(rw)
	if rc.SetReadDeadline(time.Now().Add(bodyTimeout)) != nil {
		return func() {}
	}
	return func() { rc.SetReadDeadline(time.Time{}) }
}

func fail(rw http.ResponseWriter, err error) {
	e, status := api.ErrorOf(err)
	answer(rw, status, e)
}

func reply(rw http.ResponseWriter, v any) { answer(rw, http.StatusOK, v) }

func answer(rw http.ResponseWriter, status int, v any) {
	rw.Header().Set("Content-Type", "application/json")
	rw.WriteHeader(status)
	json.NewEncoder(rw).Encode(v)
}
