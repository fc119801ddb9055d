package api

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestRoutes checks that every route is one of its method and path,
// says what it does, and names request and answer types this package
// declares (gen-docs describes them).
func TestRoutes(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	types := map[string]bool{}
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range f.Decls {
			if g, ok := d.(*ast.GenDecl); ok && g.Tok == token.TYPE {
				for _, s := range g.Specs {
					types[s.(*ast.TypeSpec).Name.Name] = true
				}
			}
		}
	}
	seen := map[string]bool{}
	for _, r := range Routes {
		key := r.Method + " " + r.Path
		switch {
		case seen[key]:
			t.Errorf("%s: listed twice", key)
		case r.Method != "" && r.Method != "GET" && r.Method != "POST" && r.Method != "PUT" && r.Method != "DELETE":
			t.Errorf("%s: method %q", key, r.Method)
		case !strings.HasPrefix(r.Path, "/"+Version+"/"):
			t.Errorf("%s: not under /%s/", key, Version)
		case r.Summary == "":
			t.Errorf("%s: no summary", key)
		case (r.RequestBody == BodyWebSocket || r.ResponseBody == BodyWebSocket) &&
			(r.Method != "GET" || r.Status != 101 || r.RequestBody != r.ResponseBody || r.Request != "" || r.Response != ""):
			t.Errorf("%s: a WebSocket is a GET answered 101, both bodies its messages", key)
		case r.Method != "" && r.Status != 200 && r.Status != 201 && r.Status != 204 && r.ResponseBody != BodyWebSocket:
			t.Errorf("%s: status %d: give 200, 201 or 204", key, r.Status)
		case r.Status == 204 && (r.Response != "" || r.ResponseBody != ""):
			t.Errorf("%s: status 204 with an answer", key)
		case !slices.Contains([]string{"", BodyLines, BodyBytes, BodyRelayed, BodyWebSocket}, r.RequestBody) ||
			!slices.Contains([]string{"", BodyLines, BodyBytes, BodyRelayed, BodyWebSocket}, r.ResponseBody):
			t.Errorf("%s: bodies %q and %q: give BodyLines, BodyBytes, BodyRelayed, BodyWebSocket or none", key, r.RequestBody, r.ResponseBody)
		case (r.Method == "") != (r.RequestBody == BodyRelayed):
			t.Errorf("%s: a route of any method is a relay, and a relay one of any method", key)
		}
		seen[key] = true
		for _, typ := range []string{r.Request, r.Response} {
			if name := strings.TrimPrefix(typ, "[]"); name != "" && !types[name] {
				t.Errorf("%s: no type %s in package api", key, name)
			}
		}
	}
}
