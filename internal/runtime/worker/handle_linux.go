package worker

import (
	"encoding/json"
	"net/http"

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
			if err := decode(r, &req); err != nil {
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
