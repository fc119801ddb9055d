package worker

import (
	"go/ast"
	"go/build"
	"go/parser"
	"go/token"
	"go/types"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/dsec-project/dsec/api"
)

// servedRoute is a route as routes registers it.
type servedRoute struct {
	handler           string // the worker's method that serves it
	admin             bool   // wrapped in adminOnly
	typed             bool   // through handle: its request and answer are its method's types
	request, response string
	status            int
}

// checksAdminItself are the handlers that refuse a token other than an
// admin's themselves, not by adminOnly.
var checksAdminItself = map[string]bool{"e2bRelayed": true}

// TestRoutesAreAPIRoutes reads the routes the worker registers (its
// routes function, as written) and checks that api.Routes, which
// docs/reference/api.md is written from, lists the same: each pattern,
// whether only an admin may call it, and, for a route served through
// handle, its request and answer types and its status.
func TestRoutesAreAPIRoutes(t *testing.T) {
	served := readRoutes(t)
	listed := map[string]bool{}
	for _, r := range api.Routes {
		key := r.Path
		if r.Method != "" {
			key = r.Method + " " + r.Path
		}
		listed[key] = true
		s, ok := served[key]
		if !ok {
			t.Errorf("api.Routes lists %s, which the worker does not serve", key)
			continue
		}
		if admin := s.admin || checksAdminItself[s.handler]; r.Admin != admin {
			t.Errorf("%s: api.Routes says admin only %v, the worker's %s %v", key, r.Admin, s.handler, admin)
		}
		if !s.typed {
			continue
		}
		if r.Request != s.request || r.Response != s.response || r.Status != s.status || r.RequestBody != "" || r.ResponseBody != "" {
			t.Errorf("%s: api.Routes says %q (%s) -> %q (%s), status %d; the worker's %s takes %q and answers %q, one JSON value each, status %d",
				key, r.Request, r.RequestBody, r.Response, r.ResponseBody, r.Status, s.handler, s.request, s.response, s.status)
		}
	}
	for key, s := range served {
		if !listed[key] {
			t.Errorf("the worker serves %s (%s), which api.Routes does not list: add it there (docs/reference/api.md is written from it)", key, s.handler)
		}
	}
}

// readRoutes parses the package's Linux sources and reads the
// HandleFunc calls of the worker's routes method.
func readRoutes(t *testing.T) map[string]servedRoute {
	t.Helper()
	ctx := build.Default
	ctx.GOOS = "linux"
	entries, err := os.ReadDir(".")
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	methods := map[string]*ast.FuncDecl{}
	for _, e := range entries {
		name := e.Name()
		if !strings.HasSuffix(name, ".go") || strings.HasSuffix(name, "_test.go") {
			continue
		}
		if ok, err := ctx.MatchFile(".", name); err != nil || !ok {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range f.Decls {
			if fd, ok := d.(*ast.FuncDecl); ok && fd.Recv != nil && len(fd.Recv.List) == 1 && types.ExprString(fd.Recv.List[0].Type) == "*worker" {
				methods[fd.Name.Name] = fd
			}
		}
	}
	routes := methods["routes"]
	if routes == nil {
		t.Fatal("no method routes of *worker: the test reads the worker's routes there")
	}
	served := map[string]servedRoute{}
	ast.Inspect(routes.Body, func(n ast.Node) bool {
		call, ok := n.(*ast.CallExpr)
		if !ok {
			return true
		}
		if sel, ok := call.Fun.(*ast.SelectorExpr); !ok || sel.Sel.Name != "HandleFunc" {
			return true
		}
		lit, ok := call.Args[0].(*ast.BasicLit)
		if !ok || lit.Kind != token.STRING {
			t.Fatalf("%s: a route's pattern that is not a string literal: the test cannot read it", fset.Position(call.Pos()))
		}
		pattern, _ := strconv.Unquote(lit.Value)
		if pattern == "/" { // the answer to a call there is none
			return false
		}
		s := servedRoute{}
		handler(t, fset, call.Args[1], &s)
		if s.typed {
			fd := methods[s.handler]
			if fd == nil {
				t.Fatalf("%s: no method %s of *worker", pattern, s.handler)
			}
			ft := fd.Type
			if inner, ok := ft.Results.List[0].Type.(*ast.FuncType); ok { // lifecycle(op): the handler it makes
				ft = inner
			}
			req := ft.Params.List[len(ft.Params.List)-1].Type
			resp := ft.Results.List[0].Type
			s.request, _ = wireType(req)
			s.response, s.status = wireType(resp)
		}
		served[pattern] = s
		return false
	})
	return served
}

// handler reads a route's handler: adminOnly(what, h), handle(w.M),
// handle(w.M(...)) or w.M.
func handler(t *testing.T, fset *token.FileSet, e ast.Expr, s *servedRoute) {
	t.Helper()
	switch e := e.(type) {
	case *ast.CallExpr:
		switch fn := e.Fun.(type) {
		case *ast.Ident:
			switch fn.Name {
			case "adminOnly":
				s.admin = true
				handler(t, fset, e.Args[1], s)
				return
			case "handle":
				s.typed = true
				handler(t, fset, e.Args[0], s)
				return
			}
		case *ast.SelectorExpr: // w.lifecycle(w.stop)
			s.handler = fn.Sel.Name
			return
		}
	case *ast.SelectorExpr: // w.exec
		s.handler = e.Sel.Name
		return
	}
	t.Fatalf("%s: a handler the test cannot read: give w.METHOD, handle(w.METHOD) or adminOnly(WHAT, ...)", fset.Position(e.Pos()))
}

// wireType is a handler's request or answer type as api.Routes names
// it, and the status handle answers with.
func wireType(e ast.Expr) (string, int) {
	if ix, ok := e.(*ast.IndexExpr); ok && types.ExprString(ix.X) == "created" {
		name, _ := wireType(ix.Index)
		return name, 201
	}
	switch s := strings.TrimPrefix(types.ExprString(e), "*"); s {
	case "none":
		return "", 204
	default:
		return strings.ReplaceAll(s, "api.", ""), 200
	}
}
