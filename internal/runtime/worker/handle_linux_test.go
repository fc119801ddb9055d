package worker

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
)

func TestHandle(t *testing.T) {
	type in struct{ N int }
	echo := handle(func(r *http.Request, req in) (created[in], error) {
		if req.N < 0 {
			return created[in]{}, fmt.Errorf("n %d: %w", req.N, errdefs.ErrInvalidArgument)
		}
		return created[in]{in{req.N + 1}}, nil
	})
	empty := handle(func(r *http.Request, _ none) (none, error) {
		if r.URL.Query().Get("fail") != "" {
			return none{}, errors.New("disk on fire")
		}
		return none{}, nil
	})
	for _, c := range []struct {
		h            http.HandlerFunc
		body, query  string
		status       int
		class, reply string
	}{
		{echo, `{"N":1}`, "", http.StatusCreated, "", `{"N":2}`},
		{echo, `{"N":-1}`, "", http.StatusBadRequest, api.ClassInvalid, ""},
		{echo, `{"M":1}`, "", http.StatusBadRequest, api.ClassInvalid, ""}, // unknown field
		{echo, `{"N":`, "", http.StatusBadRequest, api.ClassInvalid, ""},
		{echo, `{"N":1}` + strings.Repeat(" ", 1<<20) + `x`, "", http.StatusCreated, "", `{"N":2}`}, // a document, then nothing read
		{empty, `not read`, "", http.StatusNoContent, "", ""},
		{empty, ``, "fail=1", http.StatusInternalServerError, api.ClassInternal, ""},
	} {
		rec := httptest.NewRecorder()
		c.h(rec, httptest.NewRequest("POST", "/x?"+c.query, strings.NewReader(c.body)))
		if rec.Code != c.status {
			t.Errorf("%.20q: status %d, want %d (%s)", c.body, rec.Code, c.status, rec.Body)
			continue
		}
		if c.status == http.StatusNoContent {
			if rec.Body.Len() != 0 {
				t.Errorf("204 with a body %q", rec.Body)
			}
			continue
		}
		if ct := rec.Header().Get("Content-Type"); ct != "application/json" {
			t.Errorf("%.20q: content type %q", c.body, ct)
		}
		if c.class != "" {
			var e api.Error
			if json.Unmarshal(rec.Body.Bytes(), &e) != nil || e.Class != c.class {
				t.Errorf("%.20q: error %s, want class %s", c.body, rec.Body, c.class)
			}
			continue
		}
		if got := strings.TrimSpace(rec.Body.String()); got != c.reply {
			t.Errorf("%.20q: answered %s, want %s", c.body, got, c.reply)
		}
	}
}

// TestDecodeBounded: a JSON body over the bound is refused as too large,
// not read whole nor taken for a syntax error.
func TestDecodeBounded(t *testing.T) {
	var v struct{ S string }
	big := `{"S": "` + strings.Repeat("x", maxBody) + `"}`
	if err := decode(httptest.NewRequest("POST", "/", strings.NewReader(big)), &v); !errdefs.IsOutOfRange(err) {
		t.Fatalf("over the bound: %v", err)
	}
	if err := decode(httptest.NewRequest("POST", "/", strings.NewReader(`{"S": `)), &v); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("cut short: %v", err)
	}
}
