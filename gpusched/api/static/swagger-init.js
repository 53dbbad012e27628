// /docs: starts Swagger UI (served by the API from the fastapi-offline package, /docs/static) on
// the API's OpenAPI document, with FastAPI's default settings. A file of its own rather than
// FastAPI's inline snippet: the pages' Content-Security-Policy allows no inline script.
"use strict";

document.addEventListener("DOMContentLoaded", () => {
  window.ui = SwaggerUIBundle({
    url: document.getElementById("swagger-ui").dataset.openapiUrl,
    dom_id: "#swagger-ui",
    layout: "BaseLayout",
    deepLinking: true,
    showExtensions: true,
    showCommonExtensions: true,
    validatorUrl: null,  // no badge from validator.swagger.io: nothing is fetched from elsewhere
    presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
  });
});
